# Sourced by a GPU bundle's scripts (run.sh, gpu_bench.sh) with HERE set to
# the bundle: puts the bundle's lib/ on LD_LIBRARY_PATH, and where the
# bundle left the CUDA runtime out (gpu_bundle.sh --no_cuda_libs), the
# host's CUDA toolkit and the nvidia wheels of its Python.
export LD_LIBRARY_PATH="${HERE}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
if [ ! -e "${HERE}/lib/libcublas.so.13" ]; then
  wheels="$(python3 -c 'import glob, os, site
print(" ".join(sorted({os.path.dirname(p) for s in site.getsitepackages()
    for p in glob.glob(s + "/nvidia/**/libcu*.so*", recursive=True)})))' 2>/dev/null)"
  for d in /usr/local/cuda/lib64 ${wheels}; do
    [ -d "${d}" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH}:${d}"
  done
fi
