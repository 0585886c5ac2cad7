#include "kv_memory_service/store/spare_rows.h"

#include <iterator>

namespace infinigen::kv_memory_service {

SpareRows::Spare SpareRows::Remove(std::list<Spare>::iterator it) {
  Spare out = std::move(*it);
  spares_.erase(it);
  bytes_ -= out.bytes;
  return out;
}

std::vector<SpareRows::Spare> SpareRows::Keep(Spare spare) {
  std::vector<Spare> out;
  if (per_session_ <= 0) {
    out.push_back(std::move(spare));
    return out;
  }
  const SessionId session = spare.session;
  bytes_ += spare.bytes;
  spares_.push_back(std::move(spare));
  int kept = 0;
  for (const Spare& s : spares_) kept += s.session == session ? 1 : 0;
  for (auto it = spares_.begin(); kept > per_session_ && it != spares_.end();) {
    if (it->session != session) {
      ++it;
      continue;
    }
    auto next = std::next(it);
    out.push_back(Remove(it));
    --kept;
    it = next;
  }
  return out;
}

std::optional<SpareRows::Spare> SpareRows::Take(SessionId session,
                                                int64_t bytes) {
  for (auto it = spares_.rbegin(); it != spares_.rend(); ++it) {
    // use_count 1: the spare list alone holds the old sequence.
    if (it->session == session && it->bytes == bytes &&
        it->rows.use_count() == 1) {
      ++reused_;
      return Remove(std::next(it).base());
    }
  }
  return std::nullopt;
}

std::vector<SpareRows::Spare> SpareRows::TakeSession(SessionId session) {
  std::vector<Spare> out;
  for (auto it = spares_.begin(); it != spares_.end();) {
    auto next = std::next(it);
    if (it->session == session) out.push_back(Remove(it));
    it = next;
  }
  return out;
}

std::optional<SpareRows::Spare> SpareRows::TakeOldest() {
  if (spares_.empty()) return std::nullopt;
  return Remove(spares_.begin());
}

}  // namespace infinigen::kv_memory_service
