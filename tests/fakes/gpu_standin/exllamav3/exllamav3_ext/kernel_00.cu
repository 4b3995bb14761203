// stand-in translation unit 00
