// One decode step of attention over coded tokens (the CPU counterpart of kernels/attention.py's split kernels).
//
// For every head, each coded key is decoded once into its levels and met by the G query vectors (already rotated
// like the keys and scaled by the softmax scaling): logit = key scale * <q, levels>, summed over the key's
// segments (channel groups coded apart). The softmax weights of those
// logits then sum the decoded values (weight * value scale * levels). The answer is the online-softmax state over
// the coded tokens
// (max logit, sum of exp(logit - max), exp-weighted value sum in the values' rotated coordinates) that the caller
// merges with the exactly stored tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "fastscan.h"

namespace tqvec {

// How a plan's packed rows become the levels of their channels (look-up tables built from the plan, which it points
// into: it lives no longer than the plan's arrays).
class RowDecoder;

// The decoder of `plan`, built once and kept with it (building one costs tens of microseconds).
std::shared_ptr<const RowDecoder> row_decoder(const Plan& plan);

// The coded tokens of every head in one segment of channels, read by `decoder` (the row_decoder of their plan): head
// h's row r at packed + h * head_stride + r * row_bytes, its scale at scale[h * scale_stride + r]; the plan's
// channels 0 .. dim - 1 are channels first .. first + dim - 1 of the rotated query (keys) or of the weighted sum
// (values). A quantizer's codes are one segment; channel groups coded apart (each with its own rotation and scale)
// are one segment each.
struct CodedTokens {
  const RowDecoder* decoder;
  const uint8_t* packed;
  int64_t row_bytes, head_stride;
  const float* scale;
  int64_t scale_stride;
  int64_t first, dim;
};

struct DecodeArgs {
  std::vector<CodedTokens> keys, values;  // segments: a token's logit sums its key segments' scale * <q, levels>
  const float* queries;       // (heads, group, key_dim): rotated, scaled queries
  int64_t heads, group, key_dim, value_dim, n;
  const uint8_t* valid;       // (heads / heads_per_batch, n): 0 masks a token out; null: all valid
  int64_t heads_per_batch;
  int threads;
  float* max;                 // (heads, group): -inf where no token is valid
  float* sum;                 // (heads, group)
  float* acc;                 // (heads, group, value_dim)
};

void decode_attention(const DecodeArgs& a);

}  // namespace tqvec
