#include "common/flag_check.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace infinigen {
namespace {

// Levenshtein distance, for suggestions.
size_t Distance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1,
                         diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The defined flag nearest to `name`, if one is near enough to be a typo.
std::string Suggestion(absl::string_view name) {
  std::string best;
  size_t best_distance = std::max<size_t>(2, name.size() / 3) + 1;
  for (const auto& [flag_name, flag] : absl::GetAllFlags()) {
    if (flag->IsRetired()) continue;
    const size_t d = Distance(name, flag_name);
    if (d < best_distance || (d == best_distance && flag_name < best)) {
      best_distance = d;
      best = std::string(flag_name);
    }
  }
  return best;
}

absl::Status Unknown(absl::string_view name) {
  const std::string near = Suggestion(name);
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown flag --", name,
      near.empty() ? " (try --help)" : absl::StrCat(" (did you mean --", near, "?)")));
}

}  // namespace

absl::Status CheckFlags(absl::Span<char* const> args) {
  for (size_t i = 0; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (arg == "--") break;  // the rest is positional
    if (arg.size() < 2 || arg[0] != '-') continue;
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const size_t eq = arg.find('=');
    const absl::string_view name = arg.substr(0, eq);
    // Abseil's own flags that read files or the environment: its parser's.
    if (name == "flagfile" || name == "fromenv" || name == "tryfromenv" ||
        name == "undefok") {
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && eq == absl::string_view::npos &&
        absl::StartsWith(name, "no")) {
      // --nofoo: foo = false, for a boolean foo.
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) continue;
    }
    if (flag == nullptr || flag->IsRetired()) return Unknown(name);
    std::string value;
    if (eq != absl::string_view::npos) {
      value = std::string(arg.substr(eq + 1));
    } else if (flag->IsOfType<bool>()) {
      value = "true";
    } else if (i + 1 < args.size()) {
      value = args[++i];  // --flag value
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " needs a value"));
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", error));
    }
  }
  return absl::OkStatus();
}

}  // namespace infinigen
