// stand-in translation unit 08
