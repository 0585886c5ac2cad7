#include "gpu_worker/serving/chat_template.h"

#include <cstring>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "model/gguf.h"

namespace infinigen::gpu_worker {

const char* ChatTemplateName(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::kChatML:
      return "chatml";
    case ChatTemplate::kLlama2:
      return "llama2";
    case ChatTemplate::kLlama3:
      return "llama3";
    case ChatTemplate::kGemma:
      return "gemma";
  }
  return "?";
}

absl::StatusOr<ChatTemplate> ParseChatTemplate(absl::string_view name) {
  if (name == "chatml") return ChatTemplate::kChatML;
  if (name == "llama2") return ChatTemplate::kLlama2;
  if (name == "llama3") return ChatTemplate::kLlama3;
  if (name == "gemma") return ChatTemplate::kGemma;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown chat template '", name, "' (chatml, llama2, llama3 or gemma)"));
}

absl::StatusOr<ChatTemplate> DetectChatTemplate(absl::string_view jinja) {
  if (absl::StrContains(jinja, "<|im_start|>")) return ChatTemplate::kChatML;
  if (absl::StrContains(jinja, "<|start_header_id|>")) {
    return ChatTemplate::kLlama3;
  }
  if (absl::StrContains(jinja, "[INST]")) return ChatTemplate::kLlama2;
  if (absl::StrContains(jinja, "<start_of_turn>")) return ChatTemplate::kGemma;
  std::string head(jinja.substr(0, 60));
  for (char& c : head) {
    if (c == '\n') c = ' ';
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "the model's chat template is not supported (not chatml, llama2, "
      "llama3 or gemma): \"",
      head, jinja.size() > head.size() ? "...\"" : "\"",
      "; name one with --chat_template"));
}

namespace {

bool IsGguf(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplateForModel(
    const std::string& model_path, absl::string_view override_name) {
  if (!override_name.empty()) return ParseChatTemplate(override_name);
  const absl::Status none = absl::NotFoundError(
      absl::StrCat(model_path,
                   " carries no chat template (tokenizer.chat_template); name "
                   "one with --chat_template=chatml|llama2|llama3|gemma"));
  if (!IsGguf(model_path)) return none;
  IG_ASSIGN_OR_RETURN(model::GgufFile gguf, model::GgufFile::Open(model_path));
  if (gguf.Find("tokenizer.chat_template") == nullptr) {
    // Gemma 3's GGUF files carry no template; its format is Gemma's.
    if (gguf.Find("general.architecture") != nullptr) {
      IG_ASSIGN_OR_RETURN(std::string arch,
                          gguf.GetString("general.architecture"));
      if (arch == "gemma3") return ChatTemplate::kGemma;
    }
    return none;
  }
  IG_ASSIGN_OR_RETURN(std::string jinja,
                      gguf.GetString("tokenizer.chat_template"));
  return DetectChatTemplate(jinja);
}

absl::StatusOr<std::string> ApplyChatTemplate(
    ChatTemplate t, const std::vector<ChatMessage>& messages) {
  if (messages.empty()) {
    return absl::InvalidArgumentError("messages must not be empty");
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i, "].role '", role,
                       "' is not system, user or assistant"));
    }
  }
  std::string out;
  switch (t) {
    case ChatTemplate::kChatML:
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content,
                        "<|im_end|>\n");
      }
      absl::StrAppend(&out, "<|im_start|>assistant\n");
      return out;
    case ChatTemplate::kLlama3:
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|start_header_id|>", m.role,
                        "<|end_header_id|>\n\n", m.content, "<|eot_id|>");
      }
      absl::StrAppend(&out, "<|start_header_id|>assistant<|end_header_id|>\n\n");
      return out;
    case ChatTemplate::kGemma: {
      // Gemma has no system role: a system message opens the first user
      // turn, separated by a blank line; the assistant is "model".
      std::string system;
      size_t i = 0;
      if (messages[0].role == "system") {
        system = messages[0].content;
        i = 1;
      }
      for (; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "system") {
          return absl::InvalidArgumentError(
              "gemma chat: only the first message may be a system message");
        }
        std::string content = m.content;
        if (!system.empty() && m.role == "user") {
          content = absl::StrCat(system, "\n\n", content);
          system.clear();
        }
        absl::StrAppend(&out, "<start_of_turn>",
                        m.role == "assistant" ? "model" : "user", "\n",
                        content, "<end_of_turn>\n");
      }
      absl::StrAppend(&out, "<start_of_turn>model\n");
      return out;
    }
    case ChatTemplate::kLlama2: {
      // Meta's format: the system message folds into the first user turn;
      // each user turn is [INST] ... [/INST], each answer ends with </s>
      // and the next turn starts with <s>.
      std::string system;
      size_t i = 0;
      if (messages[0].role == "system") {
        system = messages[0].content;
        i = 1;
      }
      bool first = true;
      for (; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "system") {
          return absl::InvalidArgumentError(
              "llama2 chat: only the first message may be a system message");
        }
        if (m.role == "user") {
          if (!first) out += "<s>";
          out += "[INST] ";
          if (first && !system.empty()) {
            absl::StrAppend(&out, "<<SYS>>\n", system, "\n<</SYS>>\n\n");
          }
          absl::StrAppend(&out, m.content, " [/INST]");
          first = false;
        } else {
          absl::StrAppend(&out, " ", m.content, " </s>");
        }
      }
      return out;
    }
  }
  return absl::InternalError("unknown chat template");
}

}  // namespace infinigen::gpu_worker
