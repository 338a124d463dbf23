# mok — build, test and run. `make` builds the library, the `mok` command and the test
# runner, and compiles every .cu file for sm_90a when nvcc is found.
#   make test       CPU test suite (what CI runs)
#   make run        mok check + mok bench on the default shape (no GPU visible: CPU-only, in build-cpu/)
#   make test-asan  the test suite under AddressSanitizer + UBSan
#   make test-fuzz  the fuzz suite alone for FUZZ_SECONDS (default 60)

CC      ?= gcc
BUILD   ?= build
NVCC    ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CFLAGS  ?= -O3 -g
CFLAGS  += -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror=implicit-function-declaration \
           -fopenmp -ffp-contract=off -fPIC -fvisibility=hidden -Iinclude
LDLIBS  += -lm -lpthread -fopenmp

LIB_SRC  := $(wildcard src/*.c src/cpu/*.c)
TOOL_SRC := tools/problem.c
TEST_SRC := $(wildcard tests/*.c)
CU_SRC   := $(wildcard src/cuda/*.cu)
PYTHON  ?= python3

# With nvcc the library carries the CUDA backend (sm_90a kernels, static cudart): it
# builds and its CPU tests run on a machine without a GPU too.
ifneq ($(NVCC),)
CUDA_HOME := $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))
CUDA_LIB  := $(firstword $(wildcard $(CUDA_HOME)/lib64 $(CUDA_HOME)/targets/x86_64-linux/lib))
CFLAGS    += -DMOK_HAVE_CUDA -I$(CUDA_HOME)/include
LDLIBS    += -L$(CUDA_LIB) -lcudart_static -ldl -lrt -lstdc++
NVFLAGS   ?= -O3
NVFLAGS   += -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC,-fvisibility=hidden \
             -DMOK_HAVE_CUDA -Iinclude -Isrc
# NCCL (expert parallelism, src/comm/): headers at build time, libnccl.so.2 loaded at run
# time. Python's nvidia-nccl first (the NCCL that PyTorch loads into the same process,
# so kernels and library agree on NCCL's device structures), then the CUDA toolkit's.
PY_NCCL   := $(shell $(PYTHON) -c "import importlib.util as u; s = u.find_spec('nvidia.nccl'); print(list(s.submodule_search_locations)[0] if s else '')" 2>/dev/null)
NCCL_HOME ?= $(firstword $(foreach d,$(PY_NCCL) $(CUDA_HOME) /usr/local,$(if $(wildcard $(d)/include/nccl_device.h),$(d))))
ifneq ($(NCCL_HOME),)
NCCL_LIB  := $(firstword $(foreach d,$(NCCL_HOME)/lib $(NCCL_HOME)/lib64 $(CUDA_HOME)/lib $(CUDA_HOME)/lib64,$(if $(wildcard $(d)/libnccl.so.2),$(d))))
CFLAGS    += -DMOK_HAVE_NCCL
NVFLAGS   += -DMOK_HAVE_NCCL -I$(NCCL_HOME)/include -DMOK_NCCL_LIBDIR='"$(NCCL_LIB)"'
CU_SRC    += $(wildcard src/comm/*.cu)
endif
endif

LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o) $(if $(NVCC),$(CU_SRC:%.cu=$(BUILD)/%.cu.o))
TOOL_OBJ := $(TOOL_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)
MICRO    := $(if $(NVCC),$(patsubst bench/micro/%.cu,$(BUILD)/micro/%,$(wildcard bench/micro/*.cu)))

.PHONY: all test test-gpu run test-asan test-fuzz clean info micro
all: info $(BUILD)/libmok.a $(BUILD)/libmok.so $(BUILD)/mok $(BUILD)/mok_tests $(MICRO)

info:
	@echo "mok: CC=$(CC) nvcc=$(if $(NVCC),$(NVCC),not found) .cu files=$(words $(CU_SRC)) nccl=$(if $(NCCL_HOME),$(NCCL_HOME),not found)"

$(BUILD)/%.o: %.c $(wildcard include/*.h src/*.h src/cpu/*.h tools/*.h tests/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Isrc -Itools -c $< -o $@

# Local memory in a kernel is a build error (issue 3): ptxas fails on a register spill,
# and its report (kept beside the object) must show no stack frame, which is where
# arrays indexed at run time go. The report's other lines (warnings) are shown. So is
# wgmma serialisation: ptxas reports it (C7510-C7520) only as "info", and the kernel
# then runs at a fraction of its speed.
# LOCAL_MEM_OK=1: both checks off, spills only warned of, for measurement builds alone
# (bench/gpu_session.sh stalls: the stall counters' code spills ~50 bytes in the
# backward, values reloaded at task starts, not in the mainloop).
comma := ,
PTXAS_CHECK := $(if $(LOCAL_MEM_OK),-warn-spills,-warn-spills$(comma)-Werror)
$(BUILD)/%.cu.o: %.cu $(wildcard include/*.h src/*.h src/cuda/*.h src/cuda/*.cuh src/comm/*.h src/comm/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Xptxas -v,$(PTXAS_CHECK) -c $< -o $@ 2> $@.ptxas || { cat $@.ptxas >&2; exit 1; }
	@grep -vE '^ptxas info|bytes stack frame' $@.ptxas >&2 || true
	@if [ -z "$(LOCAL_MEM_OK)" ] && grep -qE '[1-9][0-9]* bytes stack frame' $@.ptxas; then \
	  grep -B2 -E '[1-9][0-9]* bytes stack frame' $@.ptxas >&2; \
	  echo "$<: a kernel uses local memory (stack frame above; full report in $@.ptxas)" >&2; rm -f $@; exit 1; fi
	@if grep -qE '\(C75[0-9][0-9]\)' $@.ptxas; then \
	  grep -E '\(C75[0-9][0-9]\)' $@.ptxas >&2; \
	  echo "$<: ptxas serialises the kernel's wgmmas (above; docs/KERNELS.md lists the causes)" >&2; rm -f $@; exit 1; fi

$(BUILD)/libmok.a: $(LIB_OBJ)
	ar rcs $@ $^

$(BUILD)/libmok.so: $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(LDLIBS)

$(BUILD)/mok: $(BUILD)/tools/mok.o $(TOOL_OBJ) $(BUILD)/libmok.a
	$(CC) -o $@ $^ $(LDLIBS)

$(BUILD)/mok_tests: $(TEST_OBJ) $(TOOL_OBJ) $(BUILD)/libmok.a
	$(CC) -o $@ $^ $(LDLIBS)

test: $(BUILD)/mok_tests
	$(BUILD)/mok_tests

# GPU suite (an H200 or H100): mok.MoE on the GPU (pytest), then the same runner built
# with the gpu suite only (its line "N passed, M failed" last).
$(BUILD)/tests/gpu/runner.o: tests/runner.c $(wildcard include/*.h tools/*.h tests/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DMOK_GPU_TESTS -Isrc -Itools -c $< -o $@

GPU_TEST_OBJ := $(BUILD)/tests/gpu/test_gpu.o $(if $(NCCL_HOME),$(BUILD)/tests/gpu/test_gpu_comm.o $(BUILD)/tests/gpu/peer_exchange.cu.o)
$(BUILD)/mok_gpu_tests: $(BUILD)/tests/gpu/runner.o $(GPU_TEST_OBJ) $(BUILD)/tests/reference.o $(TOOL_OBJ) $(BUILD)/libmok.a
	$(CC) -o $@ $^ $(LDLIBS)

# Microbenchmarks of the GPU itself (bench/micro/*.cu, run on an H200 by hand or by
# bench/gpu_session.sh micro); built with everything else when nvcc is found (MICRO is
# defined above `all`, whose prerequisites make expands where it reads them).
# MICRO_LIBS: a micro's own libraries (engine_gemm's cuBLAS peer).
micro: $(MICRO)
$(BUILD)/micro/engine_gemm: MICRO_LIBS = -lcublas
$(BUILD)/micro/%: bench/micro/%.cu $(wildcard bench/micro/*.h src/cuda/*.h src/cuda/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -o $@ $< $(MICRO_LIBS)

test-gpu: $(BUILD)/mok_gpu_tests $(BUILD)/libmok.so
	MOK_LIBRARY=$(abspath $(BUILD))/libmok.so $(PYTHON) -m pytest -q python/tests/test_cuda.py python/tests/test_cuda_ep.py
	MOK_LIBRARY=$(abspath $(BUILD))/libmok.so $(PYTHON) -m pytest -q python/tests/test_cuda_transformers.py
	$(BUILD)/mok_gpu_tests

# `make run` builds what the run needs: with nvcc found but no GPU visible (no
# /dev/nvidia0, or nvidia-smi -L fails) a CPU-only mok in build-cpu/ (NVCC=), seconds,
# not the sm_90a kernels, minutes, that nothing here could run. RUN_GPU is worked out
# once, and only when run's recipe is expanded.
RUN_GPU = $(eval RUN_GPU := $(shell [ -e /dev/nvidia0 ] && nvidia-smi -L > /dev/null 2>&1 && echo yes))$(RUN_GPU)
RUN_CPU_ONLY = $(if $(NVCC),$(if $(RUN_GPU),,yes))
RUN_MOK = $(if $(RUN_CPU_ONLY),build-cpu/mok,$(BUILD)/mok)
RUN_NOTE = make run: no GPU visible (no /dev/nvidia0, or nvidia-smi -L fails), so compiling a CPU-only mok in build-cpu/ (NVCC=), not the sm_90a kernels (minutes, for a GPU)
run:
	@$(if $(RUN_CPU_ONLY),echo "$(RUN_NOTE)")
	@$(MAKE) --no-print-directory $(if $(RUN_CPU_ONLY),NVCC= BUILD=build-cpu) $(RUN_MOK)
	$(RUN_MOK) check --shape tiny --ranks 1,2,4
	$(RUN_MOK) bench --shape tiny

# the flags go through the environment so that the Makefile's own CFLAGS += still apply;
# a UBSan report stops the run (halt_on_error), as an ASan one does. The fuzz suite runs
# for its default budget here (MOK_FUZZ_SECONDS, tests/test_fuzz.c) unless that is set.
test-asan:
	CFLAGS="-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer" LDLIBS="-fsanitize=address,undefined" \
	  $(MAKE) BUILD=build-asan build-asan/mok_tests
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 build-asan/mok_tests

# Random configs and arguments, valid and invalid, through create, forward and backward
# on W CPU ranks (tests/test_fuzz.c); a failure prints the line that replays it.
FUZZ_SECONDS ?= 60
test-fuzz: $(BUILD)/mok_tests
	MOK_FUZZ_SECONDS=$(FUZZ_SECONDS) $(BUILD)/mok_tests -k fuzz

clean:
	rm -rf build build-asan

# PyTorch binding (python/): `make python` builds the library it loads
# (build/libmok.so); `make test-python` runs its tests (needs torch and pytest).
.PHONY: python test-python
python: $(BUILD)/libmok.so

test-python: python
	MOK_LIBRARY=$(abspath $(BUILD))/libmok.so $(PYTHON) -m pytest -q python/tests
