# Compiles build-ort/libkvkernels_ort.so (run through scripts/build_ort.sh, which fetches the headers).
CXX ?= c++
SRCS := csrc/index_checks.cpp csrc/cpu/isa.cpp csrc/cpu/rows.cpp \
        $(wildcard csrc/cpu/rows_*.cpp) $(wildcard csrc/cpu/attention_*.cpp) $(wildcard csrc/ort/*.cpp)
OBJS := $(patsubst %.cpp,$(OUT)/obj/%.o,$(SRCS))
# setup.py's flags (-O3, C++17, hidden symbols: only RegisterCustomOps is exported).
CXXFLAGS := -std=c++17 -O3 -g0 -fPIC -fvisibility=hidden -Wall -DNDEBUG -Wno-psabi \
            -Icsrc -Icsrc/include -I$(ORT_INCLUDE) -isystem $(TORCH_INCLUDE) $(EXTRA_CXXFLAGS)
# EXTRA_CXXFLAGS / EXTRA_LDFLAGS: e.g. a sanitizer build into another OUT (docs/onnx.md).

$(OUT)/libkvkernels_ort.so: $(OBJS)
	$(CXX) -shared -o $@.tmp $^ -Wl,--no-undefined -Wl,-z,defs -lpthread $(EXTRA_LDFLAGS)
	mv $@.tmp $@

$(OUT)/obj/%.o: %.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -MMD -MP -c $< -o $@

-include $(OBJS:.o=.d)
