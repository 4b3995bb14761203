// stand-in translation unit 11
