# The native parts (native/: the n-gram trie, the grammar mask fill pool) are the only compiled ones;
# everything else is pure Python.
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "constrained_spec._native",
        ["native/ngram_trie.cpp", "native/mask_fill_pool.cpp", "native/bindings.cpp"],
        include_dirs=["native"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
