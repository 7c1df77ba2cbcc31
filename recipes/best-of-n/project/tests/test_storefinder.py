import unittest

import storefinder
from storefinder import Finder, distance_km, load_stores, nearest, parse_coord, within

STORES = load_stores()
BY_ID = {s.id: s for s in STORES}
PARIS = BY_ID["par"].point


class ParseCoord(unittest.TestCase):
    def test_signed_decimal_degrees(self):
        self.assertEqual(parse_coord("48.8566, 2.3522"), (48.8566, 2.3522))
        self.assertEqual(parse_coord(" -33.8688 , 151.2093 "), (-33.8688, 151.2093))

    def test_south_and_east(self):
        self.assertEqual(parse_coord("33.8688S, 151.2093E"), (-33.8688, 151.2093))

    def test_north_and_west(self):
        self.assertEqual(parse_coord("40.7128n, 74.0060w"), (40.7128, -74.006))

    def test_rejects_what_is_not_a_coordinate(self):
        for text in ("north of Paris", "48.8566", "91N, 0E", "0, 180.5"):
            with self.subTest(text=text), self.assertRaises(ValueError):
                parse_coord(text)


class Distance(unittest.TestCase):
    def test_paris_london(self):
        self.assertAlmostEqual(distance_km(PARIS, BY_ID["lon"].point), 343.6, delta=1.0)

    def test_across_the_antimeridian(self):
        # Two points 1.9 degrees of longitude apart, on either side of 180.
        self.assertAlmostEqual(distance_km((-16.0, 179.0), (-16.0, -179.1)), 203.2, delta=1.0)


class Nearest(unittest.TestCase):
    def test_nearest_measures_every_store(self):
        annecy = (45.8992, 6.1294)  # Geneva 34 km away, Lyon 100 km
        self.assertEqual(nearest(annecy, STORES).id, "gva")

    def test_within_is_nearest_first(self):
        found = within(PARIS, 360, STORES)
        self.assertEqual([s.id for s, _ in found], ["par", "bru", "lon"])
        self.assertEqual([round(km) for _, km in found], [0, 264, 344])

    def test_within_leaves_out_the_far(self):
        self.assertEqual([s.id for s, _ in within(PARIS, 100, STORES)], ["par"])


class CellTable(unittest.TestCase):
    """data/cells.json, built by setup.sh."""

    @classmethod
    def setUpClass(cls):
        cls.finder = Finder(STORES)

    def test_built_from_the_current_store_list(self):
        self.assertEqual(self.finder.built_from, storefinder.stores_digest())
        self.assertEqual(len(self.finder.cells), 32**storefinder.CELL_PRECISION)

    def test_agrees_with_measuring_every_store(self):
        # A customer a couple of km north-east of each store.
        customers = {s.id: (s.lat + 0.02, s.lon + 0.02) for s in STORES}
        found = {store: self.finder.nearest(p).id for store, p in customers.items()}
        self.assertEqual(found, {store: nearest(p, STORES).id for store, p in customers.items()})

    def test_customer_in_parramatta(self):
        self.assertEqual(self.finder.nearest(parse_coord("33.8150S, 151.0011E")).id, "syd")
