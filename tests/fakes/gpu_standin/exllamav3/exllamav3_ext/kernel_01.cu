// stand-in translation unit 01
