"""cc_grpc_proto: protobuf + gRPC C++ code from a .proto, with Debian's protoc.

Generates <name>.pb.{h,cc} and <name>.grpc.pb.{h,cc} with protoc and
grpc_cpp_plugin, and wraps them in one cc_library.
"""

def cc_grpc_proto(name, src, deps = [], visibility = None):
    base = src[:-len(".proto")]
    pkg = native.package_name()
    outs = [base + ext for ext in [".pb.h", ".pb.cc", ".grpc.pb.h", ".grpc.pb.cc"]]
    native.genrule(
        name = name + "_gen",
        srcs = [src],
        outs = outs,
        cmd = " ".join([
            "protoc",
            "-I.",
            "--cpp_out=$(GENDIR)",
            "--grpc_out=$(GENDIR)",
            "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin)",
            (pkg + "/" if pkg else "") + src,
        ]),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["//third_party:grpc"],
        visibility = visibility,
    )
