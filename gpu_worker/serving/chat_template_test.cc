#include "gpu_worker/serving/chat_template.h"

#include "gtest/gtest.h"

namespace infinigen::gpu_worker {
namespace {

// The start of SmolLM2-135M-Instruct's tokenizer.chat_template.
constexpr char kSmolLM2Jinja[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != "
    "'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named "
    "SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}";

TEST(ChatTemplate, DetectsTheFamilies) {
  EXPECT_EQ(*DetectChatTemplate(kSmolLM2Jinja), ChatTemplate::kChatML);
  EXPECT_EQ(*DetectChatTemplate("{{ '<|start_header_id|>' + role }}"),
            ChatTemplate::kLlama3);
  EXPECT_EQ(*DetectChatTemplate("{{ bos_token + '[INST] ' + content }}"),
            ChatTemplate::kLlama2);
  auto unknown = DetectChatTemplate("{{ '### Human: ' + content }}");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("not supported"),
            std::string::npos);
  EXPECT_NE(unknown.status().message().find("### Human"), std::string::npos);
}

TEST(ChatTemplate, ParsesNames) {
  EXPECT_EQ(*ParseChatTemplate("chatml"), ChatTemplate::kChatML);
  EXPECT_EQ(*ParseChatTemplate("llama2"), ChatTemplate::kLlama2);
  EXPECT_EQ(*ParseChatTemplate("llama3"), ChatTemplate::kLlama3);
  EXPECT_EQ(ParseChatTemplate("vicuna").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, ChatML) {
  EXPECT_EQ(*ApplyChatTemplate(ChatTemplate::kChatML,
                               {{"system", "Be brief."}, {"user", "Hi"}}),
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, Llama3) {
  EXPECT_EQ(*ApplyChatTemplate(ChatTemplate::kLlama3,
                               {{"user", "Hi"}, {"assistant", "Hello"},
                                {"user", "Bye"}}),
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, Llama2FoldsTheSystemMessageIntoTheFirstTurn) {
  EXPECT_EQ(*ApplyChatTemplate(ChatTemplate::kLlama2,
                               {{"system", "S"}, {"user", "Hi"},
                                {"assistant", "Hello"}, {"user", "Bye"}}),
            "[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST] Hello </s>"
            "<s>[INST] Bye [/INST]");
  EXPECT_EQ(ApplyChatTemplate(ChatTemplate::kLlama2,
                              {{"user", "Hi"}, {"system", "late"}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, GemmaOpensTheFirstUserTurnWithTheSystemMessage) {
  EXPECT_EQ(*ParseChatTemplate("gemma"), ChatTemplate::kGemma);
  EXPECT_EQ(*DetectChatTemplate("{{ '<start_of_turn>' + role }}"),
            ChatTemplate::kGemma);
  EXPECT_EQ(*ApplyChatTemplate(ChatTemplate::kGemma,
                               {{"system", "Be brief."}, {"user", "Hi"},
                                {"assistant", "Hello"}, {"user", "Bye"}}),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
            "<start_of_turn>model\nHello<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n"
            "<start_of_turn>model\n");
  EXPECT_EQ(ApplyChatTemplate(ChatTemplate::kGemma,
                              {{"user", "Hi"}, {"system", "late"}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, RejectsBadMessages) {
  EXPECT_EQ(ApplyChatTemplate(ChatTemplate::kChatML, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto bad = ApplyChatTemplate(ChatTemplate::kChatML, {{"wizard", "x"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("wizard"), std::string::npos);
}

TEST(ChatTemplate, AModelWithoutATemplateSaysHowToNameOne) {
  auto none = ChatTemplateForModel("no/such/model.bin", "");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("--chat_template"),
            std::string::npos);
  EXPECT_EQ(*ChatTemplateForModel("no/such/model.bin", "llama3"),
            ChatTemplate::kLlama3);
}

}  // namespace
}  // namespace infinigen::gpu_worker
