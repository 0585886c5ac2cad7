"""cuda_library: compiles .cu sources with nvcc into a static library.

Device code targets Hopper (sm_90) and Ampere (sm_80) with PTX for newer
GPUs. The resulting cc_library links cudart and cuBLAS; it builds on any
machine with the toolkit and runs where a GPU answers.
"""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE", "CUDA_PATH")

_GENCODE = " ".join([
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
])

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_hdrs = [], visibility = None, testonly = False):
    """Compiles `srcs` (.cu) with nvcc; headers in `hdrs` are shared with C++.

    `nvcc_hdrs`: headers of other packages the sources include (exported
    files; the cc_library declaring them must be in `deps`).
    """
    if not CUDA_AVAILABLE:
        # No toolkit: nothing to build. Dependents must check CUDA_AVAILABLE.
        return
    lib = "lib%s_cuda.a" % name
    native.genrule(
        name = name + "_nvcc",
        srcs = srcs + hdrs + nvcc_hdrs + ["@local_cuda//:nvcc", "@local_cuda//:cuda_headers"],
        outs = [lib],
        cmd = " ".join([
            CUDA_PATH + "/bin/nvcc",
            "-std=c++17 -O3 -lib -Xcompiler -fPIC --expt-relaxed-constexpr",
            _GENCODE,
            "-I.",
            "-I$(GENDIR)",
            "-o $@",
        ] + ["$(location %s)" % s for s in srcs]),
        testonly = testonly,
    )
    native.cc_library(
        name = name,
        srcs = [lib],
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart_cublas"],
        linkstatic = True,
        alwayslink = True,
        visibility = visibility,
        testonly = testonly,
    )
