"""Packaging for the Megatron-LM compatible library.

torch is declared as a range that 2.13.0 satisfies so that pip never replaces an installed CPU wheel
with a multi-GB CUDA build.
"""
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HELPERS_NOTICE = ("NOTICE: megatron.core.datasets.helpers_cpp was not built ({}); the library installs anyway "
                  "and uses its NumPy implementation of the dataset index helpers (identical results, slower).")


def _dataset_helpers_extensions():
    """The optional pybind11 module with the dataset index builders (megatron/core/datasets/helpers.cpp)."""
    try:
        import pybind11
    except ImportError:
        print(HELPERS_NOTICE.format("pybind11 is not importable at build time"), file=sys.stderr)
        return []
    return [Extension(
        "megatron.core.datasets.helpers_cpp",
        sources=["megatron/core/datasets/helpers.cpp"],
        include_dirs=[pybind11.get_include()],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden"],
        optional=True,
    )]


class OptionalBuildExt(build_ext):
    """Build extensions, but never fail the installation because a compiler or header is missing."""

    def run(self):
        try:
            super().run()
        except Exception as error:  # noqa: BLE001 - e.g. no compiler at all
            print(HELPERS_NOTICE.format(error), file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001
            print(HELPERS_NOTICE.format(error), file=sys.stderr)

INSTALL_REQUIRES = [
    "torch>=2.1,<3",
    "numpy>=1.24",
    "regex>=2022.1",
    "sentencepiece>=0.1.99",
    "tokenizers>=0.15",
    "tiktoken>=0.7",  # --tokenizer-type TikTokenizer
    "pybind11>=2.10",
    "pyyaml>=5.1",  # --yaml-cfg
]

EXTRAS = {
    # tools/run_text_generation_server.py (REST API and web page)
    "server": [
        "flask>=2.2",
    ],
    # examples/quickstart_cpu.sh: loss.png (matplotlib) and TensorBoard event files (tensorboard); optional, the
    # quickstart says what it skipped without them
    "quickstart": [
        "matplotlib>=3.5",
        "tensorboard>=2.10",
    ],
    "test": [
        "pytest>=7",
        "pytest-timeout>=2.1",
        "transformers>=4.40",
        "flask>=2.2",
        # drives Debian's chromium (/usr/bin/chromium) in the web page test; the test skips without either
        "playwright>=1.40",
    ],
    "dev": [
        "pytest>=7",
        "pytest-timeout>=2.1",
        "transformers>=4.40",
        "flask>=2.2",
        "playwright>=1.40",
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
    ext_modules=_dataset_helpers_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
