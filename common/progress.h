// Progress: a long run's progress on stderr, with its rate and the time
// left. On a terminal one line is redrawn in place with a bar; otherwise
// (a log file, a pipe) a plain line is written at most once per interval,
// and at the end; a run shorter than one interval shows only its end.
//
//   calibrating InfiniGen [=========>          ] 48% 2950/6144 tokens
//     (98.2 tokens/s, 33 s left)
//
// Owns nothing but its counters; not thread-safe (one run updates it).
#ifndef INFINIGEN_COMMON_PROGRESS_H_
#define INFINIGEN_COMMON_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace infinigen {

class Progress {
 public:
  // `total` units of work (>= 1) named `unit` ("tokens", "steps").
  // terminal: draw a bar in place; default: whether `out` is a terminal.
  Progress(std::string name, int64_t total, std::string unit,
           std::FILE* out = stderr, int terminal = -1,
           double interval_seconds = 1.0,
           std::chrono::steady_clock::time_point start =
               std::chrono::steady_clock::now());
  ~Progress();  // ends a bar's line

  // `done` units so far (clipped to total): a line when one is due, and
  // always when done reaches total.
  void Update(int64_t done);
  // A line of its own (a result along the way), not overwritten by the
  // bar.
  void Note(const std::string& line);

  // The text of one progress line, without a line end; bar_width 0: no
  // bar.
  static std::string Line(const std::string& name, int64_t done,
                          int64_t total, const std::string& unit,
                          double seconds, int bar_width);

 private:
  void Draw(int64_t done, double seconds);

  const std::string name_, unit_;
  const int64_t total_;
  std::FILE* const out_;
  const bool terminal_;
  const double interval_;
  const std::chrono::steady_clock::time_point start_;
  double last_ = 0;  // seconds of the last line (the first after one interval)
  int64_t drawn_ = -1;  // done at the last line
  bool open_line_ = false;  // a bar is on screen without its line end
};

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_PROGRESS_H_
