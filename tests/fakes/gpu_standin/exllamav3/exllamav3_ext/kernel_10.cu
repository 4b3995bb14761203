// stand-in translation unit 10
