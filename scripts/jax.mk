# Compiles the kvkernels.jax XLA FFI libraries (run through scripts/build_jax.sh, which finds the
# headers): build-jax/libkvkernels_jax.so (CPU) and, with CUDA=1, build-jax/libkvkernels_jax_cuda.so.
CXX ?= c++
NVCC ?= nvcc
CPU_SRCS := csrc/index_checks.cpp csrc/cpu/isa.cpp csrc/cpu/rows.cpp \
            $(wildcard csrc/cpu/rows_*.cpp) $(wildcard csrc/cpu/attention_*.cpp) \
            csrc/jax/jax_args.cpp csrc/jax/ops_cpu.cpp
CPU_OBJS := $(patsubst %.cpp,$(OUT)/obj/%.o,$(CPU_SRCS))
# setup.py's flags (-O3, C++17, hidden symbols: only the handlers are exported).
CXXFLAGS := -std=c++17 -O3 -g0 -fPIC -fvisibility=hidden -Wall -DNDEBUG -Wno-psabi \
            -Icsrc -Icsrc/include -isystem $(JAX_INCLUDE) -isystem $(TORCH_INCLUDE) $(EXTRA_CXXFLAGS)

# The CUDA kernels of the torch extension that paged_attention and the cache ops launch (torch-free
# launchers: attention_api.cuh, cache_ops.h), the handlers, and a small kernel of their own.
CUDA_CU := csrc/cuda/attention.cu $(filter-out csrc/cuda/attention.cu,$(wildcard csrc/cuda/attention_*.cu)) \
           csrc/cuda/cache_ops.cu csrc/jax/widen.cu
CUDA_CPP := csrc/jax/jax_args.cpp csrc/jax/ops_cuda.cpp
CUDA_OBJS := $(patsubst %.cu,$(OUT)/cuda-obj/%.o,$(CUDA_CU)) $(patsubst %.cpp,$(OUT)/cuda-obj/%.o,$(CUDA_CPP))
CUDA_ARCHS ?= -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a
NVCCFLAGS := -std=c++17 -O3 -Xcompiler=-fPIC,-fvisibility=hidden -DNDEBUG $(CUDA_ARCHS) \
             -Icsrc -Icsrc/include -isystem $(JAX_INCLUDE) $(EXTRA_NVCCFLAGS)

TARGETS := $(OUT)/libkvkernels_jax.so
ifeq ($(CUDA),1)
TARGETS += $(OUT)/libkvkernels_jax_cuda.so
endif

all: $(TARGETS)

# The JAX-specific CUDA sources alone (the handlers and their kernel; the kernels of csrc/cuda/ are
# make cuda-check's): objects only, for CI's compile check (make jax-cuda-check).
cuda-handlers: $(OUT)/cuda-obj/csrc/jax/ops_cuda.o $(OUT)/cuda-obj/csrc/jax/jax_args.o $(OUT)/cuda-obj/csrc/jax/widen.o
.PHONY: all cuda-handlers

$(OUT)/libkvkernels_jax.so: $(CPU_OBJS)
	$(CXX) -shared -o $@.tmp $^ -Wl,--no-undefined -Wl,-z,defs -lpthread $(EXTRA_LDFLAGS)
	mv $@.tmp $@

$(OUT)/obj/%.o: %.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -MMD -MP -c $< -o $@

# cudart linked statically: the library needs no libcudart.so on the loader path (jax's CUDA
# plugin brings its own from pip); XLA's streams are driver objects, usable from this runtime.
$(OUT)/libkvkernels_jax_cuda.so: $(CUDA_OBJS)
	$(NVCC) -shared $(CUDA_ARCHS) -o $@.tmp $^ -Xlinker --no-undefined -lcudart_static -ldl -lrt -lpthread
	mv $@.tmp $@

$(OUT)/cuda-obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(OUT)/cuda-obj/%.o: %.cpp
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -x cu -MMD -MP -c $< -o $@

-include $(CPU_OBJS:.o=.d) $(CUDA_OBJS:.o=.d)
