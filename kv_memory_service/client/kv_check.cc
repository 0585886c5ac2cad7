#include "kv_memory_service/client/kv_check.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace infinigen::kv_memory_service {
namespace {

absl::Status Step(const char* step, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(step, ": ", status.message()));
}

absl::Status Validate(const KvCheckOptions& o) {
  if (o.n_layers < 1 || o.n_kv_heads < 1 || o.head_dim < 1 || o.tokens < 1 ||
      o.fetches < 1) {
    return absl::InvalidArgumentError(
        "kv check: layers, KV heads, head_dim, tokens and fetches must be "
        "at least 1");
  }
  if (o.rows_per_head < 1 || o.rows_per_head > o.tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kv check: rows per head must be in [1, %d] (the tokens appended), "
        "not %d",
        o.tokens, o.rows_per_head));
  }
  return absl::OkStatus();
}

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

}  // namespace

absl::StatusOr<KvCheckReport> CheckKvService(KvClient& client,
                                             const KvCheckOptions& o) {
  if (absl::Status s = Validate(o); !s.ok()) return s;
  KvCheckReport report;
  report.data_plane = client.data_plane();

  SequenceGeometry geometry;
  geometry.n_layers = o.n_layers;
  geometry.n_kv_heads = o.n_kv_heads;
  geometry.head_dim = o.head_dim;
  geometry.max_tokens = o.tokens;
  // [layer][token][head][dim], K then V: AppendBlock's layout.
  const size_t row = o.head_dim;
  const size_t per_layer = static_cast<size_t>(o.tokens) * o.n_kv_heads * row;
  std::vector<uint16_t> k(per_layer * o.n_layers), v(k.size());
  std::mt19937_64 rng(o.seed);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<uint16_t>(rng());
    v[i] = static_cast<uint16_t>(rng());
  }

  absl::Time t0 = absl::Now();
  absl::StatusOr<SequenceId> seq = client.Open(geometry);
  report.open = absl::Now() - t0;
  if (!seq.ok()) return Step("open", seq.status());

  auto run = [&]() -> absl::Status {
    AppendBlock block;
    block.first_layer = 0;
    block.n_layers = o.n_layers;
    block.n_tokens = o.tokens;
    block.k = k;
    block.v = v;
    absl::Time t = absl::Now();
    absl::StatusOr<AppendResult> appended = client.Append(*seq, block);
    report.append = absl::Now() - t;
    if (!appended.ok()) return Step("append", appended.status());
    if (!appended->evicted.empty()) {
      return absl::InternalError(absl::StrFormat(
          "append: the node evicted %d rows of a sequence within its "
          "reservation",
          appended->evicted.size()));
    }

    std::vector<int32_t> positions(o.tokens);
    for (int32_t i = 0; i < o.tokens; ++i) positions[i] = i;
    std::vector<int32_t> indices;
    std::vector<int32_t> offsets(o.n_kv_heads + 1);
    const size_t n_indices =
        static_cast<size_t>(o.rows_per_head) * o.n_kv_heads;
    absl::StatusOr<std::unique_ptr<FetchBuffer>> buffer =
        client.NewFetchBuffer(2 * n_indices * row);
    if (!buffer.ok()) return Step("fetch buffer", buffer.status());
    std::vector<absl::Duration> times;
    for (int32_t f = 0; f < o.fetches; ++f) {
      for (int32_t layer = 0; layer < o.n_layers; ++layer) {
        indices.clear();
        for (int32_t h = 0; h < o.n_kv_heads; ++h) {
          offsets[h] = static_cast<int32_t>(indices.size());
          std::shuffle(positions.begin(), positions.end(), rng);
          indices.insert(indices.end(), positions.begin(),
                         positions.begin() + o.rows_per_head);
        }
        offsets[o.n_kv_heads] = static_cast<int32_t>(indices.size());
        FetchPlan plan{indices, offsets};
        t = absl::Now();
        absl::Status fetched = client.Fetch(*seq, layer, plan, buffer->get());
        times.push_back(absl::Now() - t);
        if (!fetched.ok()) {
          return Step(absl::StrCat("fetch of layer ", layer).c_str(), fetched);
        }
        const uint16_t* got = (*buffer)->data();
        for (int32_t h = 0; h < o.n_kv_heads; ++h) {
          for (int32_t j = offsets[h]; j < offsets[h + 1]; ++j) {
            const size_t want = layer * per_layer +
                                (static_cast<size_t>(indices[j]) *
                                     o.n_kv_heads + h) * row;
            const bool k_ok =
                std::memcmp(got + j * row, &k[want], row * 2) == 0;
            const bool v_ok = std::memcmp(got + (n_indices + j) * row,
                                          &v[want], row * 2) == 0;
            if (!k_ok || !v_ok) {
              return absl::DataLossError(absl::StrFormat(
                  "fetch: the %s row of layer %d, KV head %d, position %d "
                  "differs from the one appended",
                  k_ok ? "V" : "K", layer, h, indices[j]));
            }
          }
        }
        report.fetched_rows += static_cast<int64_t>(n_indices);
      }
    }
    std::sort(times.begin(), times.end());
    report.fetch_p50 = times[times.size() / 2];
    report.fetch_max = times.back();
    absl::StatusOr<SequenceStats> stats = client.GetSequenceStats(*seq);
    if (!stats.ok()) return Step("sequence statistics", stats.status());
    report.node_fetched_rows = stats->fetched_rows;
    if (stats->present_rows !=
        static_cast<int64_t>(o.tokens) * o.n_kv_heads * o.n_layers) {
      return absl::InternalError(absl::StrFormat(
          "sequence statistics: the node holds %d rows, %d were appended",
          stats->present_rows,
          static_cast<int64_t>(o.tokens) * o.n_kv_heads * o.n_layers));
    }
    return absl::OkStatus();
  };
  const absl::Status ran = run();
  t0 = absl::Now();
  const absl::Status closed = client.Close(*seq);
  report.close = absl::Now() - t0;
  if (!ran.ok()) return ran;
  if (!closed.ok()) return Step("close", closed);
  return report;
}

std::string FormatKvCheckReport(const KvCheckReport& r,
                                const KvCheckOptions& o) {
  return absl::StrFormat(
      "data plane %s: open %.2f ms, append %d tokens x %d layers x %d KV "
      "heads %.2f ms, %d fetches of %d rows p50 %.3f ms (max %.3f ms), %d "
      "rows equal to those appended (the node counted %d), close %.2f ms",
      r.data_plane, Ms(r.open), o.tokens, o.n_layers, o.n_kv_heads,
      Ms(r.append), o.fetches * o.n_layers, o.rows_per_head * o.n_kv_heads,
      Ms(r.fetch_p50), Ms(r.fetch_max), r.fetched_rows, r.node_fetched_rows,
      Ms(r.close));
}

}  // namespace infinigen::kv_memory_service
