"""Repository rule exposing a local CUDA toolkit as @local_cuda.

The toolkit is found at $CUDA_PATH, else at the standard install location.
Headers and libraries are symlinked into the repository so that targets can
depend on them without absolute paths in BUILD files. When no toolkit is
present, @local_cuda//:available is False and the CUDA targets are not built.
"""

def _cuda_configure_impl(ctx):
    cuda_path = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(cuda_path + "/bin/nvcc")
    available = nvcc.exists
    if available:
        ctx.symlink(cuda_path + "/include", "include")
        ctx.symlink(cuda_path + "/lib64", "lib64")
        ctx.symlink(cuda_path + "/bin", "bin")
    else:
        ctx.file("include/.empty", "")
        ctx.file("lib64/.empty", "")
        ctx.file("bin/.empty", "")
    ctx.file("defs.bzl", "CUDA_AVAILABLE = %s\nCUDA_PATH = %r\n" % (available, cuda_path))
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.inl"], allow_empty = True),
    includes = ["include"],
)

cc_library(
    name = "cudart_cublas",
    linkopts = [
        "-L%s/lib64",
        "-Wl,-rpath,%s/lib64",
        "-lcublas",
        "-lcudart",
    ],
    deps = [":cuda_headers"],
)

filegroup(
    name = "nvcc",
    srcs = glob(["bin/**"], allow_empty = True),
)
""" % (cuda_path, cuda_path))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
)
