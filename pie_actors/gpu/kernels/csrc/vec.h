// What the CPU kernels here start with: ATen and at::vec, the latter with the vector code the build
// targets. cpu_kernels.py builds them with -march=native; the capability macros below select
// at::vec's AVX-512 or AVX2 implementations to match (otherwise its portable one), so this comes
// before any ATen header.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
