// The lines `infinigen serve` logs: what a reader of the log relies on.
#include "gpu_worker/serving/serve_log.h"

#include "gtest/gtest.h"

namespace infinigen::gpu_worker {
namespace {

TEST(ServeSummaryLine, RatesStateAndWhatWasFetched) {
  ServeTotals finished;
  finished.requests = 3;
  finished.generated_tokens = 100;
  finished.bytes_fetched = 100 * 2048;
  finished.fraction_sum = 0.3;
  finished.fraction_count = 3;
  EXPECT_EQ(ServeSummaryLine(40, 250, finished, 10.0, 2, 1),
            "infinigen serve: generation 25.0 tokens/s, prompt 4.0 tokens/s, "
            "2 running, 1 waiting, 3 finished, KV 2.0 KiB fetched per token "
            "(10.0% of cached rows)");
  // Nothing fetched (ideal), nothing finished: no KV part.
  EXPECT_EQ(ServeSummaryLine(0, 50, ServeTotals(), 5.0, 1, 0),
            "infinigen serve: generation 10.0 tokens/s, prompt 0.0 tokens/s, "
            "1 running, 0 waiting, 0 finished");
}

TEST(RequestLine, SaysWhatTheRequestCost) {
  SequenceRecord r;
  r.prompt_tokens = 12;
  r.cached_tokens = 8;
  r.generated_tokens = 5;
  r.ttft_seconds = 0.0421;
  r.tpot_seconds = 0.0105;
  r.fetch.steps = 4;
  r.fetch.fraction_sum = 0.4;
  EXPECT_EQ(RequestLine(r),
            "infinigen serve: request done: prompt 12 tokens (8 reused), 5 "
            "generated, first token 42.1 ms, 10.5 ms per token, KV 10.0% of "
            "cached rows fetched");
  SequenceRecord none;
  none.prompt_tokens = 3;
  EXPECT_EQ(RequestLine(none),
            "infinigen serve: request done: prompt 3 tokens (0 reused), 0 "
            "generated");
}

}  // namespace
}  // namespace infinigen::gpu_worker
