#!/usr/bin/env bash
# Runs a Python test script with the system python3 (Bazel 4's py_test
# would need a Python toolchain).
exec python3 "$@"
