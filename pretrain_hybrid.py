"""Megatron-LM HEAD's name of ``pretrain_mamba.py`` (the same entry point)."""
from pretrain_mamba import main

if __name__ == "__main__":
    main()
