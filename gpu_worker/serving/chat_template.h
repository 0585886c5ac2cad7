// Chat templates: a conversation (`messages`) as the prompt text a chat
// model was trained on.
//
// GGUF models carry their template as Jinja source in the metadata key
// tokenizer.chat_template. There is no Jinja interpreter here: the source is
// recognised as one of the families below by its markers, and the family's
// format is written in C++. A template of no known family is an error that
// says so (the user can then name a family with --chat_template).
//
//   chatml  <|im_start|>ROLE\nCONTENT<|im_end|>\n ... <|im_start|>assistant\n
//           (SmolLM2, Qwen). A model's own template with no system message
//           may add a default one; ours adds none.
//   llama2  [INST] <<SYS>>\nSYSTEM\n<</SYS>>\n\nUSER [/INST] ASSISTANT</s><s>
//           [INST] USER [/INST]   (BOS comes from the tokenizer)
//   llama3  <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|> ...
//           <|start_header_id|>assistant<|end_header_id|>\n\n
//           (<|begin_of_text|> is BOS and comes from the tokenizer)
//   gemma   <start_of_turn>user\nSYSTEM\n\nUSER<end_of_turn>\n
//           <start_of_turn>model\nASSISTANT<end_of_turn>\n ...
//           <start_of_turn>model\n   (Gemma 3; BOS from the tokenizer; the
//           default for a gemma3 GGUF, whose file carries no template)
//
// Stateless functions; thread-safe.
#ifndef INFINIGEN_GPU_WORKER_SERVING_CHAT_TEMPLATE_H_
#define INFINIGEN_GPU_WORKER_SERVING_CHAT_TEMPLATE_H_

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace infinigen::gpu_worker {

enum class ChatTemplate { kChatML, kLlama2, kLlama3, kGemma };

const char* ChatTemplateName(ChatTemplate t);

// "chatml", "llama2", "llama3" or "gemma"; InvalidArgument otherwise.
absl::StatusOr<ChatTemplate> ParseChatTemplate(absl::string_view name);

// The family of a Jinja chat template (tokenizer.chat_template).
// InvalidArgument, quoting the start of the source, when none matches.
absl::StatusOr<ChatTemplate> DetectChatTemplate(absl::string_view jinja);

// The template of the model at `model_path`: `override_name` when it is not
// empty, else the family of its GGUF tokenizer.chat_template, else its
// architecture's (gemma for gemma3). NotFound (with
// a hint to pass --chat_template) when the model carries no template (not a
// GGUF, or no such key); InvalidArgument for an unknown override or an
// unsupported template.
absl::StatusOr<ChatTemplate> ChatTemplateForModel(
    const std::string& model_path, absl::string_view override_name);

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// The prompt text of `messages` under `t`, ending with the opening of the
// assistant's turn. InvalidArgument for no messages, an unknown role, or
// (llama2) a system message that is not the first.
absl::StatusOr<std::string> ApplyChatTemplate(
    ChatTemplate t, const std::vector<ChatMessage>& messages);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_SERVING_CHAT_TEMPLATE_H_
