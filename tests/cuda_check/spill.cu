// Dynamic indexing into a large per-thread array forces local memory.
__global__ void spill(float* x, const int* idx, int n) {
  float buf[512];
  for (int i = 0; i < 512; ++i) buf[i] = x[i * n + threadIdx.x];
  x[threadIdx.x] = buf[idx[threadIdx.x] & 511];
}
