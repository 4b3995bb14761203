// stand-in translation unit 09
