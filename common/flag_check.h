// CheckFlags: judges a command line's flags before absl::ParseCommandLine
// does, so that a binary reports an unknown flag (with the closest known
// name) or a bad value as one line of its own and exits with its usage
// status, instead of Abseil's "ERROR: ..." and exit 1.
#ifndef INFINIGEN_COMMON_FLAG_CHECK_H_
#define INFINIGEN_COMMON_FLAG_CHECK_H_

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace infinigen {

// args: the command line after the program name (and command). OK when
// every --flag / --flag=value / --flag value / --noflag names a flag the
// program defines with a value it takes; InvalidArgument otherwise, saying
// which ("unknown flag --max_new_tokns (did you mean --max_new_tokens?)",
// "--ctx: Illegal value 'x' ..."). Sets the flags it reads, as parsing
// would; positional arguments and what follows "--" are left alone.
absl::Status CheckFlags(absl::Span<char* const> args);

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_FLAG_CHECK_H_
