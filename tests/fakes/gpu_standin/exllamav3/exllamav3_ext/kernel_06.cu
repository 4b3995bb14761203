// stand-in translation unit 06
