// Minimal leveled logging to stderr.
//
// Debian's Abseil predates absl/log, so this is the project's one logging
// facility: `IG_LOG(INFO) << "loaded " << n << " tensors";`. Everything goes
// to stderr so that stdout stays clean for program output. Thread-safe: each
// message is written with a single call.
#ifndef INFINIGEN_COMMON_LOG_H_
#define INFINIGEN_COMMON_LOG_H_

#include <sstream>

namespace infinigen {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this level are dropped. Default kInfo; INFINIGEN_LOG_LEVEL
// (debug|info|warning|error) in the environment overrides it at start.
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();

namespace internal {
class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};
}  // namespace internal
}  // namespace infinigen

#define IG_LOG_LEVEL_DEBUG ::infinigen::LogLevel::kDebug
#define IG_LOG_LEVEL_INFO ::infinigen::LogLevel::kInfo
#define IG_LOG_LEVEL_WARNING ::infinigen::LogLevel::kWarning
#define IG_LOG_LEVEL_ERROR ::infinigen::LogLevel::kError

#define IG_LOG(severity)                                            \
  if (IG_LOG_LEVEL_##severity < ::infinigen::MinLogLevel()) {       \
  } else                                                            \
    ::infinigen::internal::LogMessage(IG_LOG_LEVEL_##severity,      \
                                      __FILE__, __LINE__)           \
        .stream()

#endif  // INFINIGEN_COMMON_LOG_H_
