// stand-in translation unit 04
