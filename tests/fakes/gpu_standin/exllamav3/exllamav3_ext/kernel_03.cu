// stand-in translation unit 03
