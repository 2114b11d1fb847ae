"""Zero-shot GPT evaluation: WikiText-103 perplexity and LAMBADA accuracy."""
