// stand-in translation unit 07
