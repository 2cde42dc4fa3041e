# Sourced by the scripts that run NCCL programs: puts a libnccl.so.2 on
# LD_LIBRARY_PATH (the nvidia-nccl-cu* wheel of python3, else the CUDA
# toolkit's lib folders) unless FP4KV_NCCL_LIBRARY names one, and turns
# NVLink multicast (NVLS) off.
export NCCL_NVLS_ENABLE=0
if [ -z "${FP4KV_NCCL_LIBRARY:-}" ]; then
  fp4kv_nccl_dir=$(python3 -c "import nvidia.nccl, os; print(os.path.join(os.path.dirname(nvidia.nccl.__file__), 'lib'))" 2>/dev/null || true)
  if [ -z "$fp4kv_nccl_dir" ] || [ ! -e "$fp4kv_nccl_dir/libnccl.so.2" ]; then
    fp4kv_nccl_dir=""
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
      if [ -e "$d/libnccl.so.2" ]; then fp4kv_nccl_dir=$d; break; fi
    done
  fi
  if [ -n "$fp4kv_nccl_dir" ]; then
    export LD_LIBRARY_PATH="$fp4kv_nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  unset fp4kv_nccl_dir
fi
