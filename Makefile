# m3 — top-level entry points. `make demo` and `make test` work on a fresh
# Debian machine: they install what is missing (libcjson-dev via apt-get,
# numpy via pip, and where nvcc is, cuobjdump and nvdisasm via pip for the
# machine-code check), configure with CMake and build.
#
#   make demo    build, then generate on the built-in tiny model
#   make test    build (release + ASan/UBSan) and run every test in both
#   make build   just the release build (build/m3)

JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build build-asan demo test test-release test-asan clean

all: build

deps:
	@[ -f /usr/include/cjson/cJSON.h ] || { \
	  echo "installing libcjson-dev"; \
	  $(SUDO) apt-get install -y libcjson-dev >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update >/dev/null && $(SUDO) apt-get install -y libcjson-dev; }; }
	@command -v cmake >/dev/null || { $(SUDO) apt-get update >/dev/null; $(SUDO) apt-get install -y cmake; }
	@python3 -c 'import numpy' 2>/dev/null || { \
	  echo "installing numpy"; python3 -m pip install -q numpy || \
	  $(SUDO) apt-get install -y python3-numpy; }
	@if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then \
	  python3 scripts/sass_check.py --tools >/dev/null 2>&1 || { \
	    echo "installing cuobjdump and nvdisasm (for the sass_check test)"; \
	    python3 -m pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm 2>/dev/null || \
	    echo "  not installed: the sass_check test will be skipped"; }; fi

build: deps
	cmake -S . -B build -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	cmake --build build -j $(JOBS)

# The sanitizer build leaves the CUDA backend out: nvcc's objects are not
# instrumented, and the release build compiles the kernels, checks their
# machine code (sass_check) and, on a machine with a GPU, runs the GPU
# tests (scripts/gpu-check runs them under compute-sanitizer), so here
# they would only cost CI minutes.
build-asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DM3_SANITIZE=ON -DM3_CUDA=OFF \
	  $(CMAKE_FLAGS) >/dev/null
	cmake --build build-asan -j $(JOBS)

demo: build
	./build/m3 generate --prompt "Hello, MiniMax-M3" --max-tokens 32

test-release: build
	cd build && ctest --output-on-failure -j $(JOBS)

test-asan: build-asan
	cd build-asan && ASAN_OPTIONS=detect_leaks=1:protect_shadow_gap=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS)

test: test-release test-asan

clean:
	rm -rf build build-asan
