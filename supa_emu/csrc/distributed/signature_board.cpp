#include "signature_board.h"

#include <c10/util/Exception.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <ctime>

namespace supa::bccl {

// Cross-process waits on a word of the shared mapping. The waiter sleeps in the kernel until the
// publisher's wake instead of polling, so it resumes within microseconds of a late peer's arrival
// and costs no CPU meanwhile. The futex covers the word's low 32 bits (little-endian), which
// change with every value the board stores there. A waiter counts itself in `waiters` while it
// sleeps, so a publisher makes the wake system call only when someone may be asleep: most
// publishes find nobody waiting.
bool shared_word_wait(uintptr_t address, int64_t unchanged, double timeout_s, uintptr_t waiters) {
  timespec timeout{};
  timeout.tv_sec = static_cast<time_t>(timeout_s);
  timeout.tv_nsec = static_cast<long>((timeout_s - std::floor(timeout_s)) * 1e9);
  auto* count = reinterpret_cast<int64_t*>(waiters);
  __atomic_add_fetch(count, 1, __ATOMIC_SEQ_CST);
  const long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(address), FUTEX_WAIT,
                          static_cast<uint32_t>(unchanged), &timeout, nullptr, 0);
  const int error = errno;
  __atomic_sub_fetch(count, 1, __ATOMIC_SEQ_CST);
  // 0: woken; EAGAIN: the word had already changed; EINTR: a signal (the caller re-checks).
  return rc == 0 || error == EAGAIN || error == EINTR;
}

// Of two ranks that publish and then look at each other's slot, at least one sees the other's
// write (what the board relies on to let a rank start before every peer has posted); and a
// waiter that counted itself before this store is always woken or sees the new value.
void shared_word_publish(uintptr_t address, int64_t value, uintptr_t waiters) {
  __atomic_store_n(reinterpret_cast<int64_t*>(address), value, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(reinterpret_cast<int64_t*>(waiters), __ATOMIC_SEQ_CST) != 0) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(address), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

SignatureBoard::SignatureBoard(uintptr_t base, int64_t rank, int64_t size, int64_t per_rank, int64_t ring,
                               int64_t payload)
    : words_(reinterpret_cast<int64_t*>(base)), rank_(rank), size_(size), per_rank_(per_rank), ring_(ring),
      payload_(payload) {
  TORCH_CHECK(base != 0 && 0 <= rank && rank < size && ring > 0 && payload > 0 &&
                  per_rank >= kRankHeaderWords + ring * (kSlotHeaderWords + payload),
              "bccl: inconsistent signature board geometry");
}

int64_t* SignatureBoard::slot(int64_t r, int64_t k) const {
  return block(r) + kRankHeaderWords + (k % ring_) * (kSlotHeaderWords + payload_);
}

void SignatureBoard::publish(int64_t* word, int64_t value) const {
  shared_word_publish(reinterpret_cast<uintptr_t>(word), value,
                      reinterpret_cast<uintptr_t>(block(rank_) + kWaitersWord));
}

// Compares the first `head` words of the peers' posts of collective k with this rank's: 0 if a
// posted one differs, else 1; with `all_posted`, -1 if a peer has not posted k yet.
int SignatureBoard::posted_agree(int64_t k, int64_t head, bool all_posted) const {
  const int64_t* mine = slot(rank_, k);
  int result = 1;
  for (int64_t r = 0; r < size_; ++r) {
    const int64_t* theirs = slot(r, k);
    if (r == rank_) {
      continue;
    }
    if (__atomic_load_n(theirs + kSequenceWord, __ATOMIC_SEQ_CST) != k) {
      if (all_posted) {
        return -1;
      }
      continue;
    }
    if (std::memcmp(theirs + kSlotHeaderWords, mine + kSlotHeaderWords, head * sizeof(int64_t)) != 0) {
      result = 0;
    }
  }
  return result;
}

int SignatureBoard::post(int64_t k, const std::vector<int64_t>& signature, int64_t head) const {
  for (int64_t r = 0; r < size_; ++r) {
    if (r != rank_ && __atomic_load_n(block(r) + kSettledWord, __ATOMIC_ACQUIRE) < k - ring_) {
      return -1;
    }
  }
  TORCH_CHECK(static_cast<int64_t>(signature.size()) <= payload_, "bccl: a signature holds at most ", payload_,
              " words, got ", signature.size());
  int64_t* mine = slot(rank_, k);
  std::memcpy(mine + kSlotHeaderWords, signature.data(), signature.size() * sizeof(int64_t));
  std::memset(mine + kSlotHeaderWords + signature.size(), 0, (payload_ - signature.size()) * sizeof(int64_t));
  publish(mine + kSequenceWord, k);
  if (head == 0) {
    return 2;
  }
  const int started = posted_agree(k, head, /*all_posted=*/false) == 1 ? 1 : 0;
  publish(mine + kVerdictWord, 2 * k + started);
  return started;
}

int SignatureBoard::settle_agreed(int64_t k, int64_t head) const {
  const int result = posted_agree(k, head, /*all_posted=*/true);
  if (result == 1) {
    publish(block(rank_) + kSettledWord, k);
  }
  return result;
}

}  // namespace supa::bccl
