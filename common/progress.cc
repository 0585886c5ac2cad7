#include "common/progress.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"

namespace infinigen {

Progress::Progress(std::string name, int64_t total, std::string unit,
                   std::FILE* out, int terminal, double interval_seconds,
                   std::chrono::steady_clock::time_point start)
    : name_(std::move(name)),
      unit_(std::move(unit)),
      total_(std::max<int64_t>(total, 1)),
      out_(out),
      terminal_(terminal < 0 ? isatty(fileno(out)) != 0 : terminal != 0),
      interval_(interval_seconds),
      start_(start) {}

Progress::~Progress() {
  if (open_line_) std::fputc('\n', out_);
}

std::string Progress::Line(const std::string& name, int64_t done,
                           int64_t total, const std::string& unit,
                           double seconds, int bar_width) {
  total = std::max<int64_t>(total, 1);
  done = std::clamp<int64_t>(done, 0, total);
  std::string bar;
  if (bar_width > 0) {
    const int filled = static_cast<int>(bar_width * done / total);
    bar = " [" + std::string(filled, '=') +
          (filled < bar_width ? ">" : "") +
          std::string(std::max(bar_width - filled - 1, 0), ' ') + "]";
  }
  std::string rate = "starting";
  if (done > 0 && seconds > 0) {
    const double per_second = done / seconds;
    rate = done == total
               ? absl::StrFormat("%.1f %s/s, %.0f s", per_second, unit,
                                 seconds)
               : absl::StrFormat("%.1f %s/s, %.0f s left", per_second, unit,
                                 (total - done) / per_second);
  }
  return absl::StrFormat("%s%s %d%% %d/%d %s (%s)", name, bar,
                         static_cast<int>(100 * done / total), done, total,
                         unit, rate);
}

void Progress::Draw(int64_t done, double seconds) {
  const std::string line =
      Line(name_, done, total_, unit_, seconds, terminal_ ? 24 : 0);
  if (terminal_) {
    // Back to the line's start, the line, the rest of the old one cleared.
    std::fprintf(out_, "\r%s\033[K", line.c_str());
    open_line_ = done < total_;
    if (!open_line_) std::fputc('\n', out_);
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
  last_ = seconds;
  drawn_ = done;
}

void Progress::Update(int64_t done) {
  done = std::clamp<int64_t>(done, 0, total_);
  if (done == drawn_) return;
  const double seconds = std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - start_)
                             .count();
  if (done < total_ && seconds - last_ < interval_) return;
  Draw(done, seconds);
}

void Progress::Note(const std::string& line) {
  if (open_line_) std::fputs("\r\033[K", out_);
  std::fprintf(out_, "%s\n", line.c_str());
  if (open_line_) {
    open_line_ = false;
    const int64_t done = drawn_;
    drawn_ = -1;
    Draw(done, last_);
  }
  std::fflush(out_);
}

}  // namespace infinigen
