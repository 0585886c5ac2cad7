// What the safetensors reader's files share: JSON parsing with errors that
// name the file. Private to //model:safetensors.
#ifndef INFINIGEN_MODEL_SAFETENSORS_JSON_H_
#define INFINIGEN_MODEL_SAFETENSORS_JSON_H_

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace infinigen::model {

// `text` parsed; InvalidArgument "PATH: WHAT is not valid JSON: ..." if not.
absl::StatusOr<nlohmann::json> ParseJson(std::string_view text,
                                         const std::string& path,
                                         const char* what);

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_SAFETENSORS_JSON_H_
