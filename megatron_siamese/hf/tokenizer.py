"""The byte-level tokenizer (data/corpus.py ``ByteTokenizer``) as Hugging Face tokenizer files (docs/export.md).

A byte-level BPE with no merges: the ByteLevel pre-tokenizer turns each byte into one symbol of its
256-symbol alphabet, the vocabulary maps the symbol of byte b to id b, the ByteLevel decoder turns symbols
back into bytes. End of document (256, both EOS and BOS) and padding (257) are special tokens, never added
to a text (training documents start without one).
"""

from __future__ import annotations

EOD_TOKEN, PAD_TOKEN = "<|endoftext|>", "<pad>"
EOD_ID, PAD_ID = 256, 257


def byte_level_tokenizer():
    """A ``PreTrainedTokenizerFast`` whose ids are ByteTokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()  # the 256 printable symbols standing for bytes
    symbol_of_byte = _byte_symbols()
    assert sorted(symbol_of_byte.values()) == sorted(alphabet)
    vocab = {symbol: byte for byte, symbol in symbol_of_byte.items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOD_TOKEN, PAD_TOKEN])  # ids 256, 257: the next free ones
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOD_TOKEN, eos_token=EOD_TOKEN,
                                   pad_token=PAD_TOKEN, clean_up_tokenization_spaces=False)
    if (fast.convert_tokens_to_ids(EOD_TOKEN), fast.convert_tokens_to_ids(PAD_TOKEN)) != (EOD_ID, PAD_ID):
        raise AssertionError("the special tokens did not get ByteTokenizer's ids")
    return fast


def _byte_symbols() -> dict:
    """GPT-2's byte -> printable symbol table, which the ByteLevel pre-tokenizer and decoder use:
    printable Latin-1 bytes stand for themselves, the others for 256 + their rank."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def save_tokenizer(directory: str) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``directory``."""
    byte_level_tokenizer().save_pretrained(directory)
