#!/usr/bin/env bash
# Build llama.cpp's C++ llama-server (a peer in bench/serve.py and bench/engine.py) from the
# llama-cpp-python source distribution's vendored llama.cpp: ~6 minutes on 2 cores.
#   bash bench/build_llama_server.sh [DIR]     -> DIR/llama.cpp/build/bin/llama-server (DIR: /tmp/llama-server)
set -euo pipefail
DIR=${1:-/tmp/llama-server}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$DIR" && cd "$DIR"
URL=$(curl -fsS https://pypi.org/simple/llama-cpp-python/ | grep -o "https://[^\"]*llama_cpp_python-$VERSION.tar.gz" | head -1)
curl -fsSL -o sdist.tar.gz "$URL"
tar xzf sdist.tar.gz
rm -rf llama.cpp && mv "llama_cpp_python-$VERSION/vendor/llama.cpp" llama.cpp
cmake -S llama.cpp -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > cmake.log
cmake --build llama.cpp/build --target llama-server -j"$(nproc)" > build.log
echo "$DIR/llama.cpp/build/bin/llama-server"
