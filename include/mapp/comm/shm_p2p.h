// Point-to-point messages among the processes of one node through one
// shared-memory segment: the pipeline's activations and gradients between
// stages on a node, without Gloo's TCP loopback and its threads.
//
// Every ordered pair of members (src -> dst) owns a ring of `slots` slots of
// `slot_bytes`; a message moves in pieces of at most one slot, each labelled
// with its key (tag and how many earlier messages with that tag went from src
// to dst, so a tag may repeat: the i-th send of a tag matches the i-th receive
// of it, as in MPI and Gloo) and its offset.
//
// Non-blocking and deadlock-free by construction:
//  * isend() and irecv() only post; the work happens in progress(), which every
//    call (and every wait) runs: it writes the pending pieces of this member's
//    sends into free slots, in posting order, and copies every piece addressed
//    to a posted receive out of the rings.
//  * A piece that arrives before its receive is posted stays in its slot, or,
//    when the whole ring holds such pieces, moves to a private buffer (the
//    "unexpected" queue) so the sender can go on; the receive takes it from
//    there. So a ring never stays full while its receiver waits, whatever order
//    the two sides post in, and progress never depends on a third party.
//  * A send completes once its last piece is in the ring (its buffer may be
//    reused); a receive once its last piece is copied out.
//
// A waiter spins briefly, then sleeps on its own doorbell (a futex word that
// a peer bumps after it wrote to or freed a slot of a ring the waiter uses),
// and fails with BackendError when the timeout passes or the operation's peer
// has exited (named within ~100 ms; other members may finish and exit first).
// Thread-safe: one mutex per member.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace mapp::comm {
namespace shm {
class Segment;
struct Member;
}  // namespace shm

class ShmP2P {
 public:
  struct Header;  // in the segment; defined in shm_p2p.cc
  struct Slot;    // a piece's label, followed by its bytes
  using Handle = std::uint64_t;

  // Member 0 creates the segment `name`; the others open it after the creator
  // returned (order them with a collective), with the same world and sizes.
  static std::unique_ptr<ShmP2P> create(const std::string& name, int rank, int world,
                                        std::size_t slot_bytes, int slots);
  static std::unique_ptr<ShmP2P> open(const std::string& name, int rank, int world,
                                      std::size_t slot_bytes, int slots);
  ~ShmP2P();
  ShmP2P(const ShmP2P&) = delete;
  ShmP2P& operator=(const ShmP2P&) = delete;

  // Removes the name (the mappings stay valid); call once every member opened.
  void unlink();

  int rank() const { return rank_; }
  int world() const { return world_; }
  // Bytes one ring holds (slots x slot size): a message up to this size is
  // written whole at isend(); a larger one only as the receiver frees slots,
  // i.e. while the sender is inside a call of this class.
  std::size_t ring_bytes() const { return slot_bytes_ * static_cast<std::size_t>(slots_); }

  // Posts a send of `bytes` at `data` to member `dst`. The caller keeps `data`
  // alive and unchanged until the send completed (test() or wait()).
  Handle isend(const void* data, std::size_t bytes, int dst, std::uint32_t tag);
  // Posts a receive of exactly `bytes` into `data` from member `src`; a message
  // of another size is an error at completion naming both sizes.
  Handle irecv(void* data, std::size_t bytes, int src, std::uint32_t tag);
  // Makes progress; true once the operation has completed (then forgets it).
  bool test(Handle h);
  // Makes progress until the operation completes (then forgets it); throws
  // BackendError on timeout or a dead peer, InvalidArgument on a size mismatch.
  void wait(Handle h, std::chrono::milliseconds timeout);

  // Sends and receives posted but not yet completed (for leak checks).
  std::size_t in_flight() const;

 private:
  struct Op;  // a posted send or receive, until waited on
  struct Send {
    const std::uint8_t* data;
    std::size_t bytes, sent;
    bool started;  // a piece is in the ring (a 0-byte message still sends one)
    std::uint64_t key;
    Handle handle;
  };
  struct Recv {
    std::uint8_t* data;
    std::size_t bytes;     // posted
    std::size_t total;     // of the message, from its pieces
    std::size_t received;  // bytes of its pieces seen
    std::size_t pieces;
    Handle handle;
  };
  struct Unexpected {  // pieces that came before their receive was posted
    std::vector<std::uint8_t> data;
    std::size_t total = 0, received = 0, pieces = 0;
  };
  struct Peer {
    std::unordered_map<std::uint32_t, std::uint32_t> sent_with_tag, posted_with_tag;
    std::deque<Send> pending;                             // sends not yet wholly in the ring
    std::unordered_map<std::uint64_t, Recv> posted;       // key -> receive
    std::unordered_map<std::uint64_t, Unexpected> early;  // key -> early pieces
  };

  ShmP2P(const std::string& name, int rank, int world, std::size_t slot_bytes, int slots,
         bool create);
  void* bells() const;
  shm::Member* members() const;
  Slot* slot(int src, int dst, int i) const;
  void progress();               // under mu_
  bool push(int dst, Peer& p);   // writes pending pieces to dst; true if any
  bool drain(int src, Peer& p);  // takes pieces from src; true if any slot freed
  bool finish_if_complete(const Recv& r);
  bool take_if_done(Handle h);  // forgets a completed op; throws its error
  void ring(int member);        // bumps member's doorbell and wakes it

  std::string name_;
  int rank_;
  int world_;
  std::size_t slot_bytes_;
  int slots_;
  std::size_t stride_ = 0;  // bytes per slot including its label
  std::size_t header_bytes_ = 0;
  std::unique_ptr<shm::Segment> segment_;
  void* base_ = nullptr;
  Header* header_ = nullptr;
  std::vector<Peer> peers_;
  std::unordered_map<Handle, Op> ops_;
  Handle next_ = 1;
  mutable std::mutex mu_;
};

}  // namespace mapp::comm
