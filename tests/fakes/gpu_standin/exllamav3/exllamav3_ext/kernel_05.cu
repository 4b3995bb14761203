// stand-in translation unit 05
