#!/usr/bin/env bash
# The server under load on a GPU machine (Python 3.12, CuPy, PyTorch, httpx, prometheus-client, cmake, ninja,
# nvcc; no network), one call each:
#
#   bash scripts/device_serve.sh prepare   # with pip + network: .carry/serve/whl (the server's wheels),
#                                          # .carry/serve/conv (the GGUF converter's), .carry/serve/llama.tar.xz
#   bash scripts/device_serve.sh install   # the carried wheels into $SITE (`load` with NO_INSTALL=1 then skips it)
#   bash scripts/device_serve.sh load      # GPU: `nanoeuler serve` on the 116M model in bf16 at 1, 8, 32 and 64
#                                          # streaming clients, the in-process engine beside each, prefix reuse
#                                          # with a 400-token prefix, a soak at 32 streams (SOAK s, default 240)
#   bash scripts/device_serve.sh llama     # GPU: build llama.cpp's llama-server (CUDA, sm_90) unless `build` did,
#                                          # convert the same model to GGUF bf16, serve it, the same clients
#   bash scripts/device_serve.sh check     # GPU: the server backend's and decode engine's GPU tests, the engine's share
#                                          # of prefix reuse (bench/prefix_ttft.py, profiled), then `load` with
#                                          # SOAK=0 and, with TEMPERATURE set, the same levels sampled
#   bash scripts/device_serve.sh first     # GPU: the server backend's GPU tests, then the first requests a fresh
#                                          # server answers (no unmeasured run first) with and without --warm-up
#   bash scripts/device_serve.sh overhead  # CPU only: bench/serve_overhead.py (fake engine, 0.7 ms steps + HOST_US of
#                                          # GIL-holding host work) twice, on this host's cores
#   bash scripts/device_serve.sh build     # GPU: only the build (start it in the background during a soak, whose
#                                          # figures are memory, not speed; `llama` in the next call waits for it)
#
# carry: .carry/serve (ignored, as all of .carry/ is; 32 MB: whl 7, conv 20, llama.tar.xz 4.5). Without CKPT
# the model is the `gpu` preset with random weights and a 4096-token BPE (bench/serve_load_gpu.py
# --preset gpu; the same file every time): tokens/s do not depend on training, and every answer has MAX_TOKENS tokens (ignore_eos).
# Each prints a short table last; OUT (the device's $OUT) gets the logs. SERVE_ARGS: more `nanoeuler serve`
# options for `load` and `check` (e.g. "--prefix-cache 0"). LOOP=1: `load` also times the server's generation
# loop alone, no HTTP (bench/serve_load_gpu.py --loop).
set -eu -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CARRY=$REPO/.carry/serve
SITE=${SITE:-/tmp/nanoeuler-serve-site}
WORK=${WORK:-/tmp/nanoeuler-serve}
PY=${PYTHON:-python3}
OUT=${OUT:-$WORK/out}
SOAK=${SOAK:-240}
LEVELS=${LEVELS:-1,8,32,64}
REQUESTS=${REQUESTS:-3}
MAX_TOKENS=${MAX_TOKENS:-128}
DEVICE=${DEVICE:-gpu}
CKPT=${CKPT:-}
LLAMA_SDIST=${LLAMA_SDIST:-}  # llama_cpp_python-0.3.36.tar.gz; `prepare` downloads it when not given
PLATFORMS=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)  # llguidance 1.9.1 is built for glibc 2.31
# what the server needs beyond the image (FastAPI, uvicorn, llguidance and what they import; httpx2 for the
# clients; regex for our tokenizer), at the versions of this environment
SERVE_WHEELS="fastapi starlette uvicorn click h11 pydantic pydantic_core annotated-types typing-inspection
              annotated-doc anyio typing_extensions opentelemetry-api truststore idna llguidance httpx2 httpcore2 regex"
# llama.cpp's convert_hf_to_gguf.py reads the tokenizer through transformers and imports sentencepiece
CONV_WHEELS="transformers tokenizers huggingface_hub safetensors sentencepiece tqdm"

pins() {  # "name==version" of each package as installed here; the newest where it is not installed
    $PY -c "
import importlib.metadata as m, sys
def pin(n):
    try:
        return f'{n}=={m.version(n)}'
    except m.PackageNotFoundError:
        return n
print(' '.join(pin(n) for n in sys.argv[1:]))" "$@"
}

prepare() {
    rm -rf "$CARRY/whl" "$CARRY/conv" && mkdir -p "$CARRY/whl" "$CARRY/conv"
    # shellcheck disable=SC2046,SC2086
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
        -d "$CARRY/whl" $(pins $SERVE_WHEELS)
    # shellcheck disable=SC2046,SC2086
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
        -d "$CARRY/conv" $(pins $CONV_WHEELS)
    pack_llama
    du -sh "$CARRY"/whl "$CARRY"/conv "$CARRY"/llama.tar.xz "$CARRY"
}

pack_llama() {  # llama.cpp's source as llama-cpp-python's sdist vendors it, less what a CUDA llama-server
    local tmp                                   # build and the converter never read
    tmp=$(mktemp -d)
    if [ -z "$LLAMA_SDIST" ]; then
        $PY -m pip download -q --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d "$tmp"
        LLAMA_SDIST=$tmp/llama_cpp_python-0.3.36.tar.gz
    fi
    tar -C "$tmp" -xzf "$LLAMA_SDIST" llama_cpp_python-0.3.36/vendor/llama.cpp
    local src=$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp
    rm -rf "$src"/{docs,models,media,benches,tests,examples,pocs,build,.github,tools/ui/src,tools/ui/tests}
    for b in "$src"/ggml/src/ggml-*/; do
        case $(basename "$b") in ggml-cuda|ggml-cpu) ;; *) rm -rf "$b" ;; esac
    done
    # the CMake files name every backend directory only when it is asked for; the examples and tests only
    # with LLAMA_BUILD_EXAMPLES / LLAMA_BUILD_TESTS, which `llama` turns off
    tar -C "$src/.." -cf - llama.cpp | xz -T2 -9 > "$CARRY/llama.tar.xz"
    rm -rf "$tmp"
}

install() {  # the carried wheels (and the converter's with `conv`) into $SITE, first on PYTHONPATH
    local dirs=("$CARRY/whl")
    [ "${1:-}" = conv ] && dirs+=("$CARRY/conv")
    for d in "${dirs[@]}"; do  # NO_INSTALL=1: this Python has them (a dry run on another machine)
        [ -n "${NO_INSTALL:-}" ] && break
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$d"/*.whl
    done
    export PYTHONPATH="$REPO:$SITE" PYTHONUNBUFFERED=1
    mkdir -p "$OUT" "$WORK"
    $PY -c "
import importlib
for name in ('fastapi', 'uvicorn', 'llguidance', 'httpx2', 'regex', 'cupy'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', '?'))
    except ImportError as exc:
        print(name, 'MISSING:', exc)"
    nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
}

model() {  # CKPT, or the random gpu-preset model (written once per machine)
    if [ -n "$CKPT" ]; then echo "$CKPT"; return; fi
    [ -f "$WORK/gpu.bin" ] || $PY "$REPO/bench/serve_load_gpu.py" --preset gpu --save-model "$WORK/gpu.bin" >&2
    echo "$WORK/gpu.bin"
}

load() {
    install
    local t0 ckpt prefix
    t0=$(date +%s)
    ckpt=$(model)
    prefix=${PREFIX:-400}
    $PY "$REPO/bench/serve_load_gpu.py" --ckpt "$ckpt" --device "$DEVICE" --levels "$LEVELS" --requests "$REQUESTS" \
        --max-tokens "$MAX_TOKENS" --prefix "$prefix" --soak "$SOAK" ${SPECULATIVE:+--speculative} ${LOOP:+--loop} \
        --serve-args "${SERVE_ARGS:-}" 2>&1 \
        | tee "$OUT/load.txt"
    echo "load: $(( $(date +%s) - t0 )) s in all (model file, CuPy's kernel compile, peers, levels, prefix, soak)"
}

check() {
    install > /dev/null
    local t0 rc=0
    t0=$(date +%s)
    $PY -m pytest -q -x -p no:cacheprovider -m gpu "$REPO/tests/test_serve_gpu.py" "$REPO/tests/test_engine_gpu.py" \
        2>&1 | tee "$OUT/gpu_tests.txt" | tail -3 || rc=1
    $PY "$REPO/bench/prefix_ttft.py" --preset gpu --device gpu --repeats 9 --profile 2>&1 | tee "$OUT/prefix_ttft.txt" \
        | tail -28 || true  # its status: whether the ratio met its target
    SOAK=0 load | tail -14
    if [ -n "${TEMPERATURE:-}" ]; then
        $PY "$REPO/bench/serve_load_gpu.py" --ckpt "$(model)" --levels "$LEVELS" --requests "$REQUESTS" \
            --max-tokens "$MAX_TOKENS" --temperature "$TEMPERATURE" --serve-args "${SERVE_ARGS:-}" 2>&1 \
            | tee "$OUT/load_sampled.txt" | tail -8
    fi
    echo "check: $(( $(date +%s) - t0 )) s; GPU tests: $(tail -1 "$OUT/gpu_tests.txt")"
    return $rc
}

first() {  # LEVELS (default here 1,8) of REQUESTS each on a server just started, with and without its warm-up
    install > /dev/null
    local t0 rc=0 arg
    t0=$(date +%s)
    $PY -m pytest -q -x -p no:cacheprovider -m gpu "$REPO/tests/test_serve_gpu.py" 2>&1 | tee "$OUT/gpu_tests.txt" \
        | tail -3 || rc=1
    for arg in --warm-up --no-warm-up; do
        echo "== $arg"
        $PY "$REPO/bench/serve_load_gpu.py" --ckpt "$(model)" --levels "${FIRST_LEVELS:-1,8}" --requests "$REQUESTS" \
            --warmup 0 --max-tokens "$MAX_TOKENS" --serve-args "$arg ${SERVE_ARGS:-}" 2>&1 \
            | tee "$OUT/first_${arg#--}.txt" | grep -E "warmed up|^ +[0-9]+ +[0-9]+ +[0-9]+ " || rc=1
    done
    echo "first: $(( $(date +%s) - t0 )) s; GPU tests: $(tail -1 "$OUT/gpu_tests.txt")"
    return $rc
}

overhead() {  # the server's own cost (generation in its own process, as `nanoeuler serve` runs it), twice
    install > /dev/null
    local run
    for run in 1 2; do
        echo "== run $run"
        $PY "$REPO/bench/serve_overhead.py" --levels "$LEVELS" --host-us "${HOST_US:-300}" --ttft-repeats 10 2>&1 \
            | tee "$OUT/overhead_$run.txt" | sed -n '/^clients/,/^(step/p' | head -n -1
    done
}

build_llama() {  # llama-server with CUDA for sm_90 in $WORK/llama.cpp/build; logs and seconds in $WORK
    rm -rf "$WORK/llama.cpp" "$WORK/llama_build_seconds" && mkdir -p "$WORK"
    xz -dc "$CARRY/llama.tar.xz" | tar -C "$WORK" -xf -
    local t0
    t0=$(date +%s)
    # FlashAttention kernels only for the f16 K/V cache llama-server uses by default (not every quant pair);
    # no NCCL (one GPU), no OpenSSL or web UI download (no network), no fatbin compression, no tests/examples
    cmake -S "$WORK/llama.cpp" -B "$WORK/llama.cpp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DGGML_CUDA_FA_QUANTS=f16-f16 \
        -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_COMPRESSION_MODE=none -DGGML_CCACHE=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF ${CONFIGURE_ONLY:+-DGGML_NATIVE=OFF} \
        > "$WORK/llama_cmake.log" 2>&1 || { tail -30 "$WORK/llama_cmake.log"; return 1; }
    echo "llama.cpp configured in $(( $(date +%s) - t0 )) s"
    [ -n "${CONFIGURE_ONLY:-}" ] && return 0
    cmake --build "$WORK/llama.cpp/build" --target llama-server -j "${JOBS:-16}" > "$WORK/llama_build.log" 2>&1 \
        || { tail -30 "$WORK/llama_build.log"; return 1; }
    echo "$(( $(date +%s) - t0 ))" > "$WORK/llama_build_seconds"
    echo "llama-server built in $(cat "$WORK/llama_build_seconds") s"
}

wait_build() {  # a `build` started earlier in the background: until its binary or its failure
    while pgrep -f "device_serve.sh build" > /dev/null && [ ! -f "$WORK/llama_build_seconds" ]; do sleep 5; done
}

llama() {
    install conv
    wait_build
    [ -f "$WORK/llama_build_seconds" ] || build_llama
    [ -n "${CONFIGURE_ONLY:-}" ] && return 0
    local ckpt ctx server
    ckpt=$(model)
    rm -rf "$WORK/hf"
    $PY -m nanoeuler export-hf --ckpt "$ckpt" --out "$WORK/hf"
    (cd "$WORK/llama.cpp" && $PY "$REPO/bench/llama_gguf.py" "$WORK/hf" --outtype bf16 --outfile "$WORK/model-bf16.gguf") \
        > "$OUT/llama_convert.log" 2>&1 || { tail -20 "$OUT/llama_convert.log"; return 1; }
    ctx=$($PY -c "from nanoeuler import checkpoint; print(checkpoint.load_model('$ckpt')[1].ctx_len)")
    local top=${LEVELS##*,}
    server=$WORK/llama.cpp/build/bin/llama-server
    "$server" -m "$WORK/model-bf16.gguf" -ngl 99 --parallel "$top" --ctx-size $((top * ctx)) --cont-batching \
        --host 127.0.0.1 --port 8081 --metrics > "$OUT/llama_server.log" 2>&1 &
    LLAMA_PID=$!  # global: the EXIT trap runs after this function has returned, when a local is gone (set -u)
    trap 'kill "$LLAMA_PID" 2>/dev/null || true' EXIT
    for _ in $(seq 120); do
        curl -sf http://127.0.0.1:8081/health > /dev/null && break
        kill -0 "$LLAMA_PID" 2>/dev/null || { tail -20 "$OUT/llama_server.log"; return 1; }
        sleep 1
    done
    $PY "$REPO/bench/serve_load_gpu.py" --url http://127.0.0.1:8081 --ckpt "$ckpt" --levels "$LEVELS" \
        --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" 2>&1 | tee "$OUT/llama.txt"
    echo "llama-server build: $(cat "$WORK/llama_build_seconds") s on $(nproc) cores"
}

case "${1:-}" in
    prepare) prepare ;;
    install) install ;;
    load) load ;;
    llama) llama ;;
    overhead) overhead ;;
    check) check ;;
    first) first ;;
    build) install conv > /dev/null; build_llama ;;
    *) echo "usage: $0 prepare|load|check|first|build|llama|overhead" >&2; exit 2 ;;
esac
