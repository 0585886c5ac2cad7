// InfiniGen proper: offline skewing, partial weights, online speculation.
//
// A pure library (no gRPC, no CUDA): plain arrays in, plain arrays out. The
// engine (gpu_worker) captures activations and calls these functions; the
// memory node never sees any of this. Shapes are in comments; matrices are
// row-major; `d` is the head dimension.
//
// Terms (InfiniGen, Lee et al., OSDI 2024). For every layer and KV head g
// there is a skew matrix A_g (d x d, orthogonal) shared by the query heads
// of g's group, so that
// (q A)(k A)^T = q k^T. After skewing, a few columns of q and k carry most of
// the magnitude; the partial columns of (layer, g) are the top int(d * ratio)
// of them. The partial key cache holds those columns of every cached
// skewed (post-RoPE) key. Speculation dots the approximate query's partial
// columns with the partial key cache to score every cached token, and
// selection keeps, per KV head, the tokens whose score is within alpha of
// the maximum, averaged over heads and capped by a budget.
#ifndef INFINIGEN_SPECULATOR_SPECULATOR_H_
#define INFINIGEN_SPECULATOR_SPECULATOR_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "speculator/partial_keys.h"

namespace infinigen::speculator {

// How much each (layer, KV head) loses when its attention reads only part
// of the cached tokens, measured on calibration text (ProfileLayer): for
// every fraction f of a grid, error is the mean over sampled queries of
// sum over the group's query heads h of |W_o,h (o_h - o_h(f))|^2 / |x|^2
// (x the residual stream entering the layer at the query), where o_h
// is head h's attention output over every token, o_h(f) the same over the
// top f of the tokens as selection ranks them (the largest over the group's
// heads of the head's log-softmax, as CombineHeadScores), renormalized,
// and W_o,h head h's slice of the output projection: what the residual
// stream loses, relative to its size.
// Value type.
// The same with InfiniGen's ranking (speculated from the previous layer's
// input through partial_ratio of the skewed columns) is speculated_error.
struct HeadProfile {
  int n_layers = 0;
  int n_kv_heads = 0;
  float partial_ratio = 0.0f;    // of speculated_error
  std::vector<float> fractions;  // ascending, in (0, 1]
  // [n_layers][n_kv_heads][fractions.size()] each:
  std::vector<float> error;             // the exact ranking (oracle)
  std::vector<float> speculated_error;  // InfiniGen's ranking

  bool empty() const { return fractions.empty(); }
  size_t Offset(int layer, int kv_head) const {
    return (static_cast<size_t>(layer) * n_kv_heads + kv_head) *
           fractions.size();
  }
  const float* at(int layer, int kv_head) const {
    return error.data() + Offset(layer, kv_head);
  }
  float* at(int layer, int kv_head) {
    return error.data() + Offset(layer, kv_head);
  }
  float* speculated_at(int layer, int kv_head) {
    return speculated_error.data() + Offset(layer, kv_head);
  }
  // The grid calibration measures: fine where budgets are small.
  static std::vector<float> DefaultFractions();
};

// Measures one layer for HeadProfile: q [n, n_heads, d], k and v
// [n, n_kv_heads, d] are the layer's post-RoPE queries, keys and values of
// n calibration tokens, wo [dim, n_heads * d] its output projection, x
// [n, dim] the residual stream entering the layer (each query's error is
// divided by its |x|^2, so that errors compare across layers whose
// residual norms differ; null: absolute). The queries at positions
// first_query, first_query + query_stride, ... < n attend causally; writes
// error [n_kv_heads][fractions.size()] for the exact ranking and, when
// rank_q [n, n_heads, d], rank_k [n, n_kv_heads, d] and speculated_error
// are not null, speculated_error (same shape) for the ranking by
// rank_q . rank_k (InfiniGen's speculated queries and skewed partial keys:
// the error of the selection it would make). The attention itself is
// computed once for both.
void ProfileLayer(const float* q, const float* k, const float* v,
                  const float* x, const float* rank_q, const float* rank_k,
                  int n, int n_heads, int n_kv_heads, int d,
                  const float* wo, int dim,
                  const std::vector<float>& fractions, int first_query,
                  int query_stride, float* error, float* speculated_error);

// Per-head budgets from a profile's errors (`error` [n_layers][n_kv_heads]
// [fractions.size()], one of its two): fractions b[l][g] of the cached
// tokens, 1 for layers below first_layer (they read everything), the others
// chosen to minimize the summed error (each curve interpolated linearly
// and replaced by its lower convex hull, so that greedy by slope is
// optimal) subject to their mean being mean_budget and each being at least
// min(mean_budget, floor). Returns [n_layers][n_kv_heads].
std::vector<float> AllocateBudgets(const HeadProfile& profile,
                                   const std::vector<float>& error,
                                   float mean_budget, int first_layer,
                                   float floor);

// One skew matrix per (layer, KV head). Value type; thread-compatible.
struct SkewMatrices {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  std::vector<float> a;  // [n_layers][n_kv_heads][head_dim][head_dim]
  // Measured with the skew on the same calibration text; empty in files
  // written before it existed.
  HeadProfile profile;

  const float* at(int layer, int kv_head) const {
    return a.data() +
           (static_cast<size_t>(layer) * n_kv_heads + kv_head) * head_dim *
               head_dim;
  }
  float* at(int layer, int kv_head) {
    return a.data() +
           (static_cast<size_t>(layer) * n_kv_heads + kv_head) * head_dim *
               head_dim;
  }

  // Identity matrices (no skew): the baseline that skewing is compared with.
  static SkewMatrices Identity(int n_layers, int n_kv_heads, int head_dim);

  // Binary file: magic "IGSKEW01", int32 n_layers, n_kv_heads, head_dim,
  // then the floats. Save: Internal on I/O failure, InvalidArgument if `a`
  // does not hold n_layers * n_kv_heads * head_dim^2 floats. Load: NotFound
  // for a missing file, InvalidArgument naming the file for a bad magic, a
  // truncated file, or trailing bytes.
  absl::Status Save(const std::string& path) const;
  static absl::StatusOr<SkewMatrices> Load(const std::string& path);

  // InvalidArgument unless the dimensions match the model's.
  absl::Status CheckShape(int n_layers, int n_kv_heads, int head_dim) const;
};

// The skew of one (layer, KV head), from calibration activations:
// `q` [q_rows, d] are the group's post-RoPE query rows (all its query heads'
// rows stacked), `k` [k_rows, d] the KV head's post-RoPE key rows. With
// SVDs q = U_q S_q V_q^T and k = U_k S_k V_k^T (LAPACK), A = V_q with its
// columns reordered by descending s_q[i] * s_k[i] (reference:
// skewing_controller.py). Returns A [d, d] row-major (A[r][c]: row r, column
// c), orthogonal. InvalidArgument for q_rows or k_rows < d; Internal if the
// SVD does not converge.
absl::StatusOr<std::vector<float>> ComputeSkew(const float* q, int q_rows,
                                               const float* k, int k_rows,
                                               int d);

// y[n, d] = x[n, d] . A (applies a skew to n rows).
void ApplySkew(const float* x, int n, const float* a, int d, float* y);
// The same product over rows x_stride floats apart in x and y_stride apart
// in y (one head's rows of a [tokens, heads, d] array: stride heads * d), in
// one matrix product; x and y must not overlap.
void ApplySkew(const float* x, int n, int x_stride, const float* a, int d,
               float* y, int y_stride);

// InfiniGen's prompt column sums, which rank the partial columns: adds to
// sums [heads / per_kv][d] the magnitudes |x_{t,h} . A_{h / per_kv}| of n
// tokens' rows x [n, heads, d] (query heads: per_kv query heads share a KV
// head's skew; keys: per_kv 1), given the skews transposed, skew_t
// [heads / per_kv][d][d] = A^T per KV head. 256 tokens' products at a
// time, then the tokens' magnitudes in order (token, head, column). A
// device backend does the same on its memory (PolicyOps::
// AddSkewedColumnSums).
void AddSkewedColumnSums(const float* x, int n, int heads, int per_kv, int d,
                         const float* skew_t, float* sums);

// The partial columns of each (layer, KV head): int(d * ratio) (at least 1)
// column indices, ascending.
struct PartialColumns {
  int n_layers = 0;
  int n_kv_heads = 0;
  int n_cols = 0;
  std::vector<int32_t> cols;  // [n_layers][n_kv_heads][n_cols]

  const int32_t* at(int layer, int kv_head) const {
    return cols.data() +
           (static_cast<size_t>(layer) * n_kv_heads + kv_head) * n_cols;
  }
};

// Number of partial columns for a ratio: max(1, int(d * ratio)), at most d.
int PartialColumnCount(int d, double ratio);

// Chooses one layer's partial columns: for each KV head g, the n_cols
// columns with the largest sum over the prompt and over g's query heads of
// |q_skewed| (reference: partial_weight_generation_controller.py).
// `q_skewed` is [n_tokens, n_heads, d] (post-RoPE queries already
// multiplied by their group's A). Writes [n_kv_heads][n_cols] ascending
// column indices into `cols`.
void SelectPartialColumns(const float* q_skewed, int n_tokens, int n_heads,
                          int n_kv_heads, int d, int n_cols, int32_t* cols);

// The partial key cache's rows (partial_keys.h): keys [n_rows, n_cols] ->
// rows, n_rows of PartialKeyRowBytes(n_cols) bytes each, and back.
void QuantizePartialKeys(const float* keys, int n_rows, int n_cols,
                         uint8_t* rows);
void DequantizePartialKeys(const uint8_t* rows, int n_rows, int n_cols,
                           float* keys);

// Spreads independent tasks over threads: run(n, fn) calls fn(0), ...,
// fn(n - 1), in any order and possibly at once, and returns when all have.
// SpeculateScores, CombineHeadScores and the selections take one to work
// on their KV heads (and ranges of tokens) in parallel, each task's output
// its own; null: one task after another on the caller. The results are the
// same either way.
using TaskRunner = std::function<void(int, absl::FunctionRef<void(int)>)>;

// The process's pool of the host's cores (ThreadPool::Resolve(0)) as a
// TaskRunner, for a layer's `work` scores; null below 2^16 of them, where
// threads cost more than they save.
const TaskRunner* HostTasks(size_t work);

// Speculated attention logits of one layer for one query, per query head
// (the policies combine the heads of a group with CombineHeadScores):
//   score[h][t] = sum_c q_skewed[h][cols_g[c]] * k_g,t[c] / sqrt(d)
// for h in KV head g's group, where k_g,t is partial key row [g][t] as
// read back (partial_keys.h); each row is decoded once for its group.
// `q_skewed` [n_heads, d]; `partial_k` [n_kv_heads][k_stride] rows of
// PartialKeyRowBytes(n_cols, format) bytes (the partial columns of the
// skewed cached keys, token-major per head); `cols` [n_kv_heads][n_cols];
// `scores` [n_heads][n_tokens].
void SpeculateScores(const float* q_skewed, int n_heads, int n_kv_heads,
                     int d, const uint8_t* partial_k, int k_stride,
                     int n_tokens, const int32_t* cols, int n_cols,
                     float* scores,
                     PartialKeyFormat format = PartialKeyFormat::kInt4,
                     const TaskRunner* run = nullptr);

// Per KV head g and token t, the largest over g's query heads h of h's
// speculated log-probability: head_scores [n_heads][n_tokens] (logits, as
// SpeculateScores computes them) minus h's log-sum-exp over
// the present tokens. A token one head attends to strongly ranks high
// even where another head's logits are larger throughout (the max of raw
// logits would let that head decide). `present` [n_kv_heads][n_tokens] (0:
// evicted, never ranked) or null; writes scores [n_kv_heads][n_tokens],
// -inf where nothing is present.
void CombineHeadScores(const float* head_scores, int n_heads, int n_kv_heads,
                       int n_tokens, const uint8_t* present, float* scores,
                       const TaskRunner* run = nullptr);

struct SelectionOptions {
  // A token is a candidate when its score >= the head's max score - alpha
  // (4 for OPT, 5 for Llama-2 in the paper).
  float alpha = 5.0f;
  // Cap on the tokens fetched per head, as a fraction of the cached tokens:
  // k <= max(1, int(n_tokens * max_fraction)).
  float max_fraction = 0.2f;
};

// Selection (reference accuracy path): count_g = #{t : present[g][t] and
// score[g][t] >= max over present t of score[g][t] - alpha} per KV head;
// k = round(mean of count_g), clamped to [1, cap] and to the fewest present
// tokens of any head; each head then selects its own top-k present tokens by
// score (ties: lower position). Writes ascending positions into `indices`
// (n_kv_heads * k values, head-major, resized) and `head_offsets`
// (n_kv_heads + 1, resized); returns k (0 when a head has no present
// token). `present` is [n_kv_heads][n_tokens] with 0 for tokens the pool
// evicted, or null when every token is present. Reuses the vectors'
// capacity and a thread-local scratch: no allocation once they are grown.
int SelectTokens(const float* scores, int n_kv_heads, int n_tokens,
                 const uint8_t* present, const SelectionOptions& options,
                 std::vector<int32_t>& indices,
                 std::vector<int32_t>& head_offsets,
                 const TaskRunner* run = nullptr);

// Per-head top-k: KV head g takes its k[g] highest-scoring present tokens
// (at most its present count; ties: lower position). Writes ascending
// positions per head into `indices` and `head_offsets` (n_kv_heads + 1);
// returns the total selected. `present` as in SelectTokens.
int SelectTopKPerHead(const float* scores, int n_kv_heads, int n_tokens,
                      const uint8_t* present, const int* k,
                      std::vector<int32_t>& indices,
                      std::vector<int32_t>& head_offsets,
                      const TaskRunner* run = nullptr);

// Adaptive selection by score mass (our variant, not the paper's): each
// KV head takes its present tokens in descending score until they carry
// `mass` (in (0, 1]) of the head's speculated attention, softmax(score)
// over its present tokens, at least one and at most
// max(1, int(n_tokens * max_fraction)). A head whose attention is peaked
// takes few tokens, a spread one more, so the budget goes where attention
// is spread. Writes ascending positions per head into `indices` and
// `head_offsets` (n_kv_heads + 1); returns the total selected (0 when a
// head has no present token). `present` as in SelectTokens.
int SelectByMass(const float* scores, int n_kv_heads, int n_tokens,
                 const uint8_t* present, float mass, float max_fraction,
                 std::vector<int32_t>& indices,
                 std::vector<int32_t>& head_offsets);

}  // namespace infinigen::speculator

#endif  // INFINIGEN_SPECULATOR_SPECULATOR_H_
