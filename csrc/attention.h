// One decode step of attention over a compressed KV cache (the CPU counterpart of kernels/attention.py's split
// kernels): coded tokens, and the tokens kept exactly (the sinks before them, the window after them).
//
// For every head, each coded key is decoded once into its levels and met by the G query vectors (rotated like the
// keys and scaled by the softmax scaling): logit = key scale * <q, levels>, summed over the key's segments (channel
// groups coded apart). The softmax weights of those logits then sum the decoded values (weight * value scale *
// levels): the online-softmax state over the coded tokens (max logit, sum of exp(logit - max), exp-weighted value
// sum in the values' rotated coordinates). decode_step then rotates that sum back, adds the value mean, and merges it
// with the exact tokens' softmax (logit = <q, key - key mean>).
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

// The coded tokens of one step and where their online-softmax state goes (decode_step fills in the buffers).
struct DecodeArgs {
  std::vector<CodedTokens> keys, values;  // segments: a token's logit sums its key segments' scale * <q, levels>
  const float* queries;       // (heads, group, key_dim): rotated, scaled queries
  int64_t heads, group, key_dim, value_dim, n;
  const uint8_t* valid;       // (heads / heads_per_batch) rows of valid_stride, n read: 0 masks a token out; null: all valid
  int64_t valid_stride;
  int64_t heads_per_batch;
  int threads;
  float* max;                 // (heads, group): -inf where no token is valid
  float* sum;                 // (heads, group)
  float* acc;                 // (heads, group, value_dim)
};

// Tokens of every head kept exactly: head h's keys and values (count, dim) float32 at keys / values + h * count * dim;
// their validity at columns first_column .. first_column + count - 1 of the validity rows.
struct ExactTokens {
  const float* keys;
  const float* values;
  int64_t count, first_column;
};

struct StepArgs {
  DecodeArgs coded;           // the coded tokens; decode_step fills in its queries, valid, max, sum and acc
  const float* queries;       // (heads, group, dim): scaled by the softmax scaling, not rotated
  int64_t dim;
  const float* key_rotation;  // (dim, key_dim) of head h at + (h % heads_per_batch) * key_rotation_stride (0: shared)
  int64_t key_rotation_stride;
  const float* value_back;    // (value_dim, dim) from the values' rotated channels, likewise per head
  int64_t value_back_stride;
  const float* key_mean;      // (heads, dim)
  const float* value_mean;    // (heads, dim)
  ExactTokens sinks, window;  // validity columns: sinks, then the coded tokens, then the window
  const uint8_t* valid;       // (heads / heads_per_batch, sinks + n + window): 0 masks a token out; null: all valid
  float* out;                 // (heads, group, dim): the attention output, 0 where no token is valid
};

// One decode step: the coded tokens' online-softmax state merged with the exact tokens'.
void decode_step(const StepArgs& s);

}  // namespace tqvec
