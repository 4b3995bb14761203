from tests.fakes.exllamav3 import create_ll_tokenizer

__all__ = ["create_ll_tokenizer"]
