# The native parts (native/: the n-gram trie, the grammar mask fill pool, the CPU bfloat16 kernels)
# are the only compiled ones; everything else is pure Python.
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "constrained_spec._native",
        ["native/ngram_trie.cpp", "native/mask_fill_pool.cpp", "native/cpu_kernels.cpp", "native/cpu_attention.cpp",
         "native/amx_linear.cpp",
         "native/forward_step.cpp",
         "native/bindings.cpp"],
        include_dirs=["native"],
        cxx_std=17,
        # no FMA contraction: the CPU kernels must round where torch's ops do (native/cpu_kernels.h);
        # no errno / trap semantics for float math (as torch is built), which lets their loops vectorize;
        # `omp simd` marks the one reduction they may reorder; OpenMP's runtime splits the small-row
        # projections (native/amx_linear.h) between the threads torch's own OpenMP ops run on (the
        # module is imported after torch, so both use the libgomp torch loaded: one thread pool)
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
