#include "gpu_worker/kv/policies/registry.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gtest/gtest.h"
#include "model/llama2c.h"

namespace infinigen::gpu_worker {
namespace {

using ::testing::HasSubstr;

const PolicyKind kEveryKind[] = {
    PolicyKind::kFull, PolicyKind::kInfiniGen, PolicyKind::kH2O,
    PolicyKind::kInt4, PolicyKind::kOracle,    PolicyKind::kQuest,
};

TEST(PolicyRegistry, EveryKindHasOneEntryWhoseNameParsesBack) {
  std::set<std::string> names;
  for (PolicyKind kind : kEveryKind) {
    const PolicyEntry& entry = PolicyEntryOf(kind);
    EXPECT_EQ(entry.kind, kind);
    EXPECT_TRUE(names.insert(entry.name).second) << entry.name;
    EXPECT_EQ(*ParsePolicy(entry.name), kind);
    EXPECT_EQ(FindPolicy(entry.name), &entry);
    EXPECT_NE(std::string(entry.summary), "");
  }
  EXPECT_EQ(Policies().size(), names.size());
  EXPECT_EQ(FindPolicy("bogus"), nullptr);
  const absl::Status unknown = ParsePolicy("bogus").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.message()),
              HasSubstr("'bogus' (full, infinigen, h2o, int4, oracle, quest)"));
}

// "ideal" is no policy: --policy's name for the local cache.
TEST(PolicyRegistry, IdealIsTheLocalCacheNotAPolicy) {
  EXPECT_EQ(FindPolicy(kLocalCacheName), nullptr);
  KvOptions kv;
  ASSERT_TRUE(ChoosePolicy("infinigen", kv).ok());
  ASSERT_TRUE(kv.policy.has_value());
  EXPECT_EQ(kv.policy->kind, PolicyKind::kInfiniGen);
  EXPECT_STREQ(kv.policy_name(), "infinigen");
  kv.policy->selection.budget = 0.5f;
  ASSERT_TRUE(ChoosePolicy("h2o", kv).ok());  // keeps the other fields
  EXPECT_EQ(kv.policy->selection.budget, 0.5f);
  ASSERT_TRUE(ChoosePolicy("ideal", kv).ok());
  EXPECT_FALSE(kv.policy.has_value());
  EXPECT_STREQ(kv.policy_name(), "ideal");
  const absl::Status unknown = ChoosePolicy("bogus", kv);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.message()),
              HasSubstr("'bogus' (ideal, full, infinigen, h2o, int4, oracle, "
                        "quest)"));
  EXPECT_FALSE(kv.policy.has_value());  // unchanged
}

TEST(PolicyRegistry, EveryPolicyHasAFactory) {
  for (const PolicyEntry* entry : Policies()) {
    SCOPED_TRACE(entry->name);
    EXPECT_NE(entry->create, nullptr);
    EXPECT_NE(entry->state_bytes, nullptr);
    // A chosen fetch is what a target fetch sets.
    if (entry->traits.selects) {
      EXPECT_NE(entry->set_target_fetch, nullptr);
    }
  }
}

class PolicyFactoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto w = model::LoadLlama2cWeights("models/stories260K/stories260K.bin");
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = std::move(*w);
    skew_ = speculator::SkewMatrices::Identity(
        weights_.config.n_layers, weights_.config.n_kv_heads,
        weights_.config.head_dim);
  }
  model::Weights weights_;
  speculator::SkewMatrices skew_;
};

TEST_F(PolicyFactoryTest, EveryOffloadingPolicyBuildsAndSizesItsState) {
  KvPolicy::Context context{&weights_, /*backend=*/nullptr,
                            /*max_seq_len=*/64};
  for (const PolicyEntry* entry : Policies()) {
    SCOPED_TRACE(entry->name);
    PolicyOptions options;
    options.kind = entry->kind;
    options.infinigen.skew = &skew_;
    absl::StatusOr<int64_t> bytes = KvPolicy::StateBytes(options, context);
    auto policy = KvPolicy::CreateUninitialized(options, context);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    ASSERT_TRUE(policy.ok()) << policy.status();
    // Policies that keep per-token state say so; full and int4 keep none.
    EXPECT_EQ(*bytes > 0, entry->kind != PolicyKind::kFull &&
                              entry->kind != PolicyKind::kInt4);
    EXPECT_EQ((*policy)->row_format() == KvRowFormat::kInt4,
              entry->kind == PolicyKind::kInt4);
  }
}

TEST(PolicyRegistry, TraitsDecideTheOptionChecks) {
  PolicyOptions options;
  options.kind = PolicyKind::kInfiniGen;  // speculates: needs a skew
  EXPECT_THAT(std::string(options.Validate().message()),
              HasSubstr("infinigen policy needs a skew"));
  options.kind = PolicyKind::kQuest;
  options.infinigen.adaptive_budgets = true;
  const absl::Status adaptive = options.Validate();
  EXPECT_EQ(adaptive.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(adaptive.message()),
              HasSubstr("adaptive budgets apply to infinigen and oracle, not "
                        "quest"));
  options = PolicyOptions();
  options.kind = PolicyKind::kFull;
  const absl::Status target = SetTargetFetch(0.1, 8, options);
  EXPECT_THAT(std::string(target.message()),
              HasSubstr("applies to infinigen, h2o, oracle, quest, not full"));
  options.kind = PolicyKind::kQuest;
  options.selection.dense_layers = 0;
  EXPECT_TRUE(options.SelectsLayerZero());
  EXPECT_TRUE(options.SpeculatesFromOwnInput());
  options.kind = PolicyKind::kH2O;
  EXPECT_FALSE(options.SelectsLayerZero());
  ASSERT_TRUE(SetTargetFetch(0.25, 8, options).ok());
  EXPECT_FLOAT_EQ(options.selection.budget, 0.25f);
}

// Each policy checks the options structs it reads, and no other's.
TEST(PolicyRegistry, EachPolicyChecksItsOwnOptions) {
  const auto skew = speculator::SkewMatrices::Identity(2, 1, 8);
  auto check = [&](PolicyKind kind, void (*set)(PolicyOptions&)) {
    PolicyOptions options;
    options.kind = kind;
    options.infinigen.skew = &skew;
    set(options);
    return options.Validate();
  };
  auto no_pages = [](PolicyOptions& o) { o.quest.page_tokens = 0; };
  EXPECT_THAT(std::string(check(PolicyKind::kQuest, no_pages).message()),
              HasSubstr("page_tokens must be >= 1"));
  EXPECT_TRUE(check(PolicyKind::kInfiniGen, no_pages).ok());
  EXPECT_TRUE(check(PolicyKind::kFull, no_pages).ok());
  auto bad_alpha = [](PolicyOptions& o) { o.infinigen.alpha = -1; };
  EXPECT_THAT(std::string(check(PolicyKind::kInfiniGen, bad_alpha).message()),
              HasSubstr("alpha must be >= 0"));
  EXPECT_TRUE(check(PolicyKind::kQuest, bad_alpha).ok());
  EXPECT_TRUE(check(PolicyKind::kH2O, bad_alpha).ok());
  auto bad_budget = [](PolicyOptions& o) { o.selection.budget = 2; };
  for (PolicyKind kind : {PolicyKind::kH2O, PolicyKind::kQuest,
                          PolicyKind::kOracle, PolicyKind::kInfiniGen}) {
    EXPECT_THAT(std::string(check(kind, bad_budget).message()),
                HasSubstr("budget must be in (0, 1]"))
        << PolicyName(kind);
  }
  EXPECT_TRUE(check(PolicyKind::kFull, bad_budget).ok());
  EXPECT_TRUE(check(PolicyKind::kInt4, bad_budget).ok());
}

// The flags an entry lists are those of the options it reads: a budget and
// a target fetch wherever the fetch is chosen, the selection's flags where
// layers select, page size only for quest; no flag listed twice.
TEST(PolicyRegistry, EachPolicyListsTheFlagsOfItsOptions) {
  auto lists = [](const PolicyEntry& e, absl::string_view flag) {
    return std::count(e.flags.begin(), e.flags.end(), flag);
  };
  for (const PolicyEntry* entry : Policies()) {
    SCOPED_TRACE(entry->name);
    std::set<std::string> unique(entry->flags.begin(), entry->flags.end());
    EXPECT_EQ(unique.size(), entry->flags.size());
    EXPECT_EQ(lists(*entry, "target_fetch"),
              entry->set_target_fetch != nullptr ? 1 : 0);
    EXPECT_EQ(lists(*entry, "budget"), entry->set_target_fetch != nullptr);
    EXPECT_EQ(lists(*entry, "dense_layers"), entry->traits.selects ? 1 : 0);
    EXPECT_EQ(lists(*entry, "head_budgets"),
              entry->traits.adaptive_budgets ? 1 : 0);
    EXPECT_EQ(lists(*entry, "page_tokens"), entry->kind == PolicyKind::kQuest);
    EXPECT_EQ(entry->validate == nullptr, entry->flags.empty());
  }
  EXPECT_EQ(PoliciesReadingFlag("page_tokens"), "quest");
  EXPECT_EQ(PoliciesReadingFlag("budget"), "infinigen, h2o, oracle and quest");
  const std::vector<std::string> all = PolicyFlagNames();
  EXPECT_EQ(std::set<std::string>(all.begin(), all.end()).size(), all.size());
  EXPECT_NE(std::find(all.begin(), all.end(), "page_tokens"), all.end());
}

}  // namespace
}  // namespace infinigen::gpu_worker
