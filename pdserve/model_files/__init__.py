"""Model files before any engine starts: GGUF parsing, the built-in models, tokenizer loading,
the TP split check (torch-free).
"""
