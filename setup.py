"""Packaging for the Megatron-LM compatible library.

torch is declared as a range that 2.13.0 satisfies so that pip never replaces an installed CPU wheel
with a multi-GB CUDA build.
"""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch>=2.1,<3",
    "numpy>=1.24",
    "regex>=2022.1",
    "sentencepiece>=0.1.99",
    "tokenizers>=0.15",
    "pybind11>=2.10",
]

EXTRAS = {
    "test": [
        "pytest>=7",
        "pytest-timeout>=2.1",
        "transformers>=4.40",
    ],
    "dev": [
        "pytest>=7",
        "pytest-timeout>=2.1",
        "transformers>=4.40",
        "ruff>=0.4",
    ],
}

setup(
    name="megatron-lm-compat",
    version="0.1.0",
    description="A Megatron-LM compatible library for training large transformer language models, CPU-testable",
    license="Apache-2.0",
    packages=find_packages(include=["megatron", "megatron.*"]),
    package_data={"megatron": ["**/*.cpp", "**/*.html", "**/Makefile"]},
    python_requires=">=3.9",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
