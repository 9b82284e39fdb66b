"""Tokenizers: loaded by Hugging Face name or local file, or a byte-level BPE trained, and their end-of-text token
(tokenizer); GPT-2's original vocab.json + merges.txt files (bpe_files)."""
