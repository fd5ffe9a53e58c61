//! Every reader takes untrusted bytes from the network: none may panic, whatever arrives.

use mr_pgproto::*;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    #[test]
    fn readers_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64), tag in any::<u8>()) {
        let _ = startup_len(&bytes);
        let _ = parse_startup(&bytes);
        let _ = header(&bytes, MAX_MESSAGE);
        let mut msg = vec![tag];
        msg.extend_from_slice(&bytes);
        let _ = read_query(&msg);
        let _ = read_parse(&msg);
        let _ = read_bind(&msg);
        let _ = read_target(&msg);
        let _ = read_execute(&msg);
        let _ = read_command_complete(&msg);
        let _ = read_fields(&msg);
        let _ = read_backend_key(&msg);
        let _ = read_auth(&msg);
        let _ = read_data_row(&msg);
    }

    /// A startup packet of any declared length either frames as that length or is refused;
    /// never accepted past the limit.
    #[test]
    fn startup_lengths_are_bounded(len in any::<i32>()) {
        match startup_len(&len.to_be_bytes()) {
            Ok(Some(n)) => prop_assert!((8..=MAX_STARTUP).contains(&n)),
            Ok(None) => prop_assert!(false, "four bytes are a length"),
            Err(_) => prop_assert!(len < 8 || len as usize > MAX_STARTUP),
        }
    }
}
