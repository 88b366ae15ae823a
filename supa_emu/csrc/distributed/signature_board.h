// bccl's signature board (supa_emu/distributed/gloo/signature_exchange.py): the steps that run on every
// collective, one call each. Python keeps the waiting, the liveness checks and the error messages.
#pragma once

#include <cstdint>
#include <vector>

namespace supa::bccl {

// Layout, in int64 words from the mapping's base: per rank `per_rank` words, a header [pid,
// settled, waiters] and `ring` slots of [sequence, verdict, payload (`payload` words)]. These
// offsets are the layout's one definition: Python reads them through _board_layout().
constexpr int64_t kPidWord = 0, kSettledWord = 1, kWaitersWord = 2, kRankHeaderWords = 3;
constexpr int64_t kSequenceWord = 0, kVerdictWord = 1, kSlotHeaderWords = 2;

// Sleeps until the shared word at `address` is woken or no longer holds `unchanged` (false: timed
// out), counted in the word at `waiters` meanwhile. Call it without the GIL.
bool shared_word_wait(uintptr_t address, int64_t unchanged, double timeout_s, uintptr_t waiters);
// Stores `value` sequentially consistently, then wakes the word's waiters if any are counted.
void shared_word_publish(uintptr_t address, int64_t value, uintptr_t waiters);

// One rank's view of a group's board. It holds the mapping's address, not the mapping: Python
// pins the mapping for as long as it uses this object.
class SignatureBoard {
 public:
  SignatureBoard(uintptr_t base, int64_t rank, int64_t size, int64_t per_rank, int64_t ring, int64_t payload);

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }

  // Posts this rank's signature of collective k. Returns -1 if a peer has not settled collective
  // k - ring (its slot is still in use: nothing is posted, the caller waits and retries);
  // otherwise, with `head` > 0, decides at once whether this rank may start, from the peers that
  // have posted k: 1 if their first `head` words all equal this rank's, 0 if one differs, and
  // posts that verdict; with `head` == 0 it returns 2 and the caller decides.
  int post(int64_t k, const std::vector<int64_t>& signature, int64_t head) const;
  // For collective k, which this rank started: 1 if every peer has posted it with the same first
  // `head` words (then this rank marks k settled), 0 if all posted and one differs, -1 if one has
  // not posted yet. Never waits.
  int settle_agreed(int64_t k, int64_t head) const;

 private:
  int64_t* block(int64_t r) const { return words_ + r * per_rank_; }
  int64_t* slot(int64_t r, int64_t k) const;
  void publish(int64_t* word, int64_t value) const;
  int posted_agree(int64_t k, int64_t head, bool all_posted) const;

  int64_t* words_;
  int64_t rank_, size_, per_rank_, ring_, payload_;
};

}  // namespace supa::bccl
