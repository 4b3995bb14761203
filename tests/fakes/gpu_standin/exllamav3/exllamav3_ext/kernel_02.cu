// stand-in translation unit 02
