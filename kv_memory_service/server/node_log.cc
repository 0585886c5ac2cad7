#include "kv_memory_service/server/node_log.h"

#include "absl/strings/str_format.h"

namespace infinigen::kv_memory_service {

std::string NodeSummaryLine(const StoreStats& now, const StoreStats& before,
                            const ServedBytes& served, double seconds) {
  const double s = seconds > 0 ? seconds : 1;
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  std::string held = absl::StrFormat("%.2f GiB reserved",
                                     now.bytes_reserved / kGiB);
  if (now.pinned_bytes > 0) {
    held += absl::StrFormat(
        " + %.2f GiB pinned by clients (%d closed sequences)",
        now.pinned_bytes / kGiB, now.pinned_sequences);
  }
  if (now.capacity_bytes > 0) {
    held += absl::StrFormat(" of %.2f GiB", now.capacity_bytes / kGiB);
  }
  return absl::StrFormat(
      "kv_memory_server: %d sequences, %d sessions, %s; fetch %.3f GB/s "
      "(%.0f fetches/s, %.0f rows/s), append %.3f GB/s (%.0f rows/s), "
      "%.0f rows/s evicted",
      now.open_sequences, now.open_sessions, held, served.fetched / s / 1e9,
      (now.fetches - before.fetches) / s,
      (now.fetched_rows - before.fetched_rows) / s,
      served.appended / s / 1e9,
      (now.appended_rows - before.appended_rows) / s,
      (now.evicted_rows - before.evicted_rows) / s);
}

bool NodeWasBusy(const StoreStats& now, const StoreStats& before,
                 const ServedBytes& served) {
  return now.fetches != before.fetches ||
         now.appended_rows != before.appended_rows ||
         now.open_sequences != before.open_sequences ||
         now.open_sessions != before.open_sessions ||
         now.pinned_bytes != before.pinned_bytes || served.fetched > 0 ||
         served.appended > 0;
}

}  // namespace infinigen::kv_memory_service
